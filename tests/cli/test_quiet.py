"""`raypipe.cli.quiet`: which of the workers' lines a quiet driver leaves out."""

from __future__ import annotations

import pytest

from raypipe.cli import quiet

CONSTRUCTOR = (
    "[2026-11-25 18:11:42,461 E 13288 13454] core_worker.cc:2465: Actor with class name: "
    "'MapWorker(MapBatches(RankPreprocessor))' and ID: 'c904559bae8726dd0010823d01000000' has "
    "constructor arguments in the object store and max_restarts > 0. If the arguments in the "
    "object store go out of scope or are lost, the actor restart will fail."
)
REPORT = "Reporting training result 3: TrainingReport(checkpoint=None, metrics={'epoch': 2})"


def test_benign_lines_go_and_everything_else_stays():
    kept = [
        "epoch 0: loss 1.5683  val_acc 0.855  230 samples/s",
        "[2026-11-25 18:11:42,461 E 13288 13454] core_worker.cc:2465: Actor with class name: "
        "'MapWorker' and ID: 'c9' died unexpectedly",  # an error that matters
        "raypipe: skipped /data/x.jpg (key 5): truncated_image",
        "  Reporting training result 3: TrainingReport(",  # not at the start: someone else's
    ]
    data = {"pid": 1, "lines": [CONSTRUCTOR, kept[0], REPORT, *kept[1:]]}
    assert quiet.drop_benign(data) == {"pid": 1, "lines": kept}
    assert quiet.drop_benign({"pid": 1, "lines": [CONSTRUCTOR, REPORT]}) is None


@pytest.mark.parametrize(("flag", "env", "verbose"), [
    (False, None, False), (False, "", False), (False, "0", False), (False, "1", True),
    (True, None, True), (True, "0", True),
])  # fmt: skip
def test_verbose_from_the_flag_or_the_environment(monkeypatch, flag, env, verbose):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(quiet.VERBOSE_ENV, env)
    assert quiet.is_verbose(flag) is verbose


def test_the_filter_wraps_the_printer_of_a_running_driver_once(ray_session):
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed = []
    dispatcher.add_handler("ray_print_logs", printed.append)
    try:
        assert quiet.filter_worker_logs() is True
        assert quiet.filter_worker_logs() is False  # already wrapped
        dispatcher.emit({"pid": 7, "lines": [CONSTRUCTOR, "epoch 1: loss 0.3"]})
        dispatcher.emit({"pid": 7, "lines": [REPORT]})
    finally:
        dispatcher.remove_handler("ray_print_logs")
    assert printed == [{"pid": 7, "lines": ["epoch 1: loss 0.3"]}]
