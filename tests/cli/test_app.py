"""The command line: help everywhere, and bad input → one clear line, exit 2, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raypipe.cli import app as cli
from raypipe.cli import jobspec
from raypipe.cli.jobapi import job_address
from raypipe.cli.submit import entrypoint
from tests.conftest import make_imagefolder

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["demo-data", "run", "convert", "preprocess", "inspect", "submit", "bench"]
ALIASES = {"preprocess": "convert"}  # old name → the command it runs


def _raypipe(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raypipe", *args], cwd=cwd, capture_output=True, text=True
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _error_line(capsys, argv: list[str]) -> str:
    """Run ``raypipe argv`` in-process; it must fail with exactly one line on stderr."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: raypipe {ALIASES.get(command, command)}" in capsys.readouterr().out


def test_every_command_the_parser_takes_is_carried_out():
    """The parser (`raypipe.cli.parser`) and the dispatch table name the same commands."""
    import argparse

    from raypipe.cli.parser import build_parser

    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(cli.COMMANDS)
    assert cli.COMMANDS["preprocess"] is cli.COMMANDS["convert"]


def test_python_dash_m_and_top_level_help():
    done = _raypipe("--help")
    assert done.returncode == 0
    for command in COMMANDS:
        assert command in done.stdout


@pytest.fixture
def folder(tmp_path):
    return make_imagefolder(tmp_path / "imgs", {"a": 3, "b": 2})


@pytest.fixture
def run_config(tmp_path, folder):
    return _write(
        tmp_path / "run.yaml",
        f"""
        data:
          source: {folder}
          image_size: 8
          batch_size: 2
        trainer:
          num_workers: 1
          epochs: 1
        """,
    )


def test_missing_config(capsys, tmp_path):
    for command in ("run", "preprocess", "submit"):
        line = _error_line(capsys, [command, str(tmp_path / "nope.yaml")])
        assert "config file not found" in line and "nope.yaml" in line


def test_malformed_config(capsys, tmp_path):
    bad = _write(tmp_path / "bad.yaml", "data:\n  source: x\n  size: [unclosed\n")
    assert f"{bad}:4:1: not valid YAML: expected ',' or ']'" in _error_line(
        capsys, ["run", str(bad)]
    )
    scalar = _write(tmp_path / "scalar.yaml", "just text\n")
    assert "expected a mapping" in _error_line(capsys, ["run", str(scalar)])


def test_unknown_keys_are_named_with_a_suggestion(capsys, tmp_path, folder):
    cfg = _write(tmp_path / "c.yaml", f"data:\n  source: {folder}\n  batch_sise: 4\n")
    line = _error_line(capsys, ["run", str(cfg)])
    assert "'batch_sise' (did you mean 'batch_size'?)" in line
    cfg = _write(tmp_path / "s.yaml", f"data:\n  source: {folder}\ntrainner:\n  epochs: 1\n")
    assert "did you mean 'trainer'?" in _error_line(capsys, ["run", str(cfg)])
    cfg = _write(tmp_path / "p.yaml", f"preprocess:\n  source: {folder}\n  out: o\n  shard: 2\n")
    assert "did you mean 'shards'?" in _error_line(capsys, ["preprocess", str(cfg)])
    assert "did you mean 'shards'?" in _error_line(capsys, ["submit", str(cfg)])


def test_bad_values_and_paths(capsys, tmp_path, folder):
    cfg = _write(tmp_path / "r.yaml", "data:\n  source: no/such/folder\n")
    line = _error_line(capsys, ["run", str(cfg), "--data-root", str(tmp_path)])
    assert line.endswith(
        f"{cfg}: data.source 'no/such/folder' is relative to {tmp_path} (the current folder, "
        "or --data-root), which does not hold it: run from the folder that does, or pass "
        "--data-root"
    )
    cfg = _write(tmp_path / "p.yaml", "preprocess:\n  source: missing\n  out: o\n")
    assert "preprocess.source 'missing' is relative to" in _error_line(
        capsys, ["preprocess", str(cfg)]
    )
    cfg = _write(tmp_path / "a.yaml", f"data:\n  source: {tmp_path}/gone\n")
    assert f"path '{tmp_path}/gone' does not exist" in _error_line(capsys, ["run", str(cfg)])
    cfg = _write(tmp_path / "f.yaml", f"preprocess:\n  source: {folder}\n  out: o\n  format: zip\n")
    assert "convert.format='zip'" in _error_line(capsys, ["preprocess", str(cfg)])
    cfg = _write(tmp_path / "n.yaml", "nothing: 1\n")
    assert "unknown key(s) 'nothing'" in _error_line(capsys, ["run", str(cfg)])


def test_mistakes_a_newcomer_makes_are_named_where_they_are(capsys, tmp_path, folder):
    """The data folder given for the config, an empty YAML, an output folder that cannot
    be made, a convert config's bad key: each said so, naming the file or setting (they
    said "config file not found" for a folder that is there, "got NoneType", a bare
    "[Errno 17] File exists", "convert: unknown key(s)" with no file)."""
    line = _error_line(capsys, ["run", str(folder)])
    assert line.endswith(f"{folder} is a folder, not a config file (a YAML such as "
                         "jobs/configs/digits.yaml; its data.source names the data)")  # fmt: skip
    empty = _write(tmp_path / "empty.yaml", "")
    assert f"{empty}: the file is empty" in _error_line(capsys, ["run", str(empty)])
    taken = _write(tmp_path / "notes.txt", "a file where a folder would go")
    cfg = _write(tmp_path / "r.yaml", f"data: {{source: {folder}, batch_size: 2}}\n"
                                      f"trainer: {{storage_path: {taken}}}\n")  # fmt: skip
    line = _error_line(capsys, ["run", str(cfg)])
    assert line.endswith(f"{cfg}: trainer.storage_path '{taken}': cannot make the folder: "
                         "File exists")  # fmt: skip
    line = _error_line(capsys, ["run", str(cfg), "--storage-path", f"{taken}/runs"])
    assert f"--storage-path '{taken}/runs': cannot make the folder: Not a directory" in line
    bad = _write(tmp_path / "c.yaml", f"convert:\n  source: {folder}\n  out: o\n  shard: 2\n")
    assert f"{bad}: convert: unknown key(s) 'shard'" in _error_line(capsys, ["convert", str(bad)])
    out = _write(tmp_path / "o.yaml", f"convert:\n  source: {folder}\n  out: {taken}/o\n")
    line = _error_line(capsys, ["convert", str(out)])
    assert f"{out}: convert.out '{taken}/o': cannot make the folder: Not a directory" in line


def test_an_eval_set_with_other_classes_is_refused_before_ray(capsys, tmp_path):
    train = make_imagefolder(tmp_path / "train", {"cat": 2, "dog": 2, "fox": 2})
    val = make_imagefolder(tmp_path / "val", {"cat": 1, "fox": 1})  # fox would be label 1
    cfg = _write(
        tmp_path / "r.yaml", f"data:\n  source: {train}\n  batch_size: 2\neval:\n  source: {val}\n"
    )
    line = _error_line(capsys, ["run", str(cfg)])
    assert "has the classes (2: cat, fox), the training source (3: cat, dog, fox)" in line


@pytest.mark.parametrize("workers", ["0", "-1", "'2'"])
def test_a_bad_worker_count_is_one_line_before_the_sources_are_listed(capsys, tmp_path, folder,
                                                                     workers):  # fmt: skip
    cfg = _write(
        tmp_path / "w.yaml", f"data:\n  source: {folder}\ntrainer:\n  num_workers: {workers}\n"
    )
    assert "num_workers=" in _error_line(capsys, ["run", str(cfg)])


def test_a_batch_no_rank_can_fill_is_refused_before_ray(capsys, monkeypatch, tmp_path):
    """8 images over 2 workers cannot fill a batch of 8: refused in the command, before it
    starts (or joins) a Ray, as train_ddp would refuse it after."""
    train = make_imagefolder(tmp_path / "train", {"cat": 4, "dog": 4})
    cfg = _write(tmp_path / "r.yaml", f"data:\n  source: {train}\n  batch_size: 8\n"
                 "trainer:\n  num_workers: 2\n")  # fmt: skip

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the batch size was checked")

    monkeypatch.setattr(cli, "_ray_session", no_ray)
    line = _error_line(capsys, ["run", str(cfg)])
    assert "batch_size=8 is larger than one rank's share (8 samples / 2 workers = 4)" in line


def test_bench_and_submit_find_the_checkout_from_anywhere(monkeypatch, tmp_path):
    from raypipe.cli.submit import _repo_root

    monkeypatch.chdir(tmp_path)
    assert cli.BENCH_SCRIPT == ROOT / "benchmarks" / "ingest.py" and cli.BENCH_SCRIPT.is_file()
    assert _repo_root() == ROOT


def test_wrong_kind_of_config(capsys, tmp_path, folder, run_config):
    pre = _write(tmp_path / "p.yaml", f"preprocess:\n  source: {folder}\n  out: o\n")
    assert "use raypipe convert" in _error_line(capsys, ["run", str(pre)])
    assert "use raypipe run" in _error_line(capsys, ["preprocess", str(run_config)])
    both = _write(tmp_path / "b.yaml", f"data:\n  source: {folder}\nconvert:\n  source: x\n")
    assert "both a run config's 'data' and a convert config's 'convert'" in _error_line(
        capsys, ["run", str(both)]
    )  # said "unknown key(s) 'data'; known: convert"
    empty = _write(tmp_path / "e.yaml", "eval:\n  source: x\n")
    assert "neither a run config" in _error_line(capsys, ["submit", str(empty)])
    lm = str(ROOT / "jobs" / "configs" / "tokens-lm.yaml")  # said "unknown key(s) 'model'"
    assert f"python jobs/train_lm.py {lm}" in _error_line(capsys, ["run", lm])
    ranks = str(ROOT / "jobs" / "configs" / "torchrun.yaml")  # said "unknown key(s)"
    assert f"jobs/torchrun_train.py {ranks}" in _error_line(capsys, ["run", ranks])
    every = _write(
        tmp_path / "c.yaml", f"data:\n  source: {folder}\ntrainer:\n  checkpoint_every: 100\n"
    )  # train_ddp's keyword, not a run config's key
    assert "unknown key(s) 'checkpoint_every'" in _error_line(capsys, ["run", str(every)])


def test_workers_lines_come_without_colour_codes_into_a_file(monkeypatch, tmp_path):
    import io

    from raypipe.cli.localray import plain_prefixes

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    plain_prefixes(io.StringIO())  # a file or pipe, as `raypipe run > run.log` has
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # the user's own choice stands
    plain_prefixes(io.StringIO())
    assert os.environ["RAY_COLOR_PREFIX"] == "1"


def test_version_and_examples_in_the_help(capsys):
    import raypipe

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert (
        done.value.code == 0 and capsys.readouterr().out.strip() == f"raypipe {raypipe.__version__}"
    )
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "examples:\n  raypipe demo-data" in capsys.readouterr().out


def test_the_classifier_job_says_it_needs_named_classes(capsys, tmp_path, datasets):
    """A WebDataset of integer labels is refused before Ray, saying what the job needs (it
    said "an image folder", though converted shards and string labels serve too)."""
    cfg = _write(
        tmp_path / "wds.yaml", f"data: {{source: {datasets['webdataset']}, batch_size: 2}}\n"
    )
    line = _error_line(capsys, ["run", str(cfg)])
    assert "needs named classes" in line and "webdataset and names none" in line
    assert "labels from the first of .cls, .json, .txt members" in line


def test_a_label_column_not_there_is_named_not_called_integer_labels(capsys, tmp_path):
    """Parquet whose labels are in a column the config does not name: the job said it had
    integer labels only, which sent users converting labels that needed no converting."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import image_bytes

    rng = __import__("numpy").random.default_rng(0)
    images = [{"bytes": image_bytes(rng), "path": f"{i}.jpg"} for i in range(4)]
    table = pa.table({"img": images, "cls": ["cat", "dog", "cat", "dog"]})
    pq.write_table(table, tmp_path / "b.parquet")
    cfg = _write(tmp_path / "pq.yaml", f"data: {{source: {tmp_path / 'b.parquet'}, "
                                       "image_column: img, batch_size: 2}\n")  # fmt: skip
    line = _error_line(capsys, ["run", str(cfg)])
    assert "parquet and names none" in line and "integer" not in line
    assert "column 'label' missing (the files have ['img', 'cls'])" in line


def test_submit_to_an_unreachable_head(capsys, run_config, tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    argv = ["submit", str(run_config), "--address", url, "--working-dir", str(tmp_path)]
    line = _error_line(capsys, argv)
    assert f"cannot reach a Ray job API at {url}" in line


@pytest.mark.parametrize(
    "address", ["http://127.0.0.1:notaport", "ftp://127.0.0.1:8265", "http://"]
)
def test_submit_to_a_malformed_address(capsys, run_config, tmp_path, address):
    argv = ["submit", str(run_config), "--address", address, "--working-dir", str(tmp_path)]
    assert "is not a job API URL" in _error_line(capsys, argv)


def test_submit_checks_before_contacting_anyone(capsys, run_config, tmp_path):
    outside = ["submit", str(run_config), "--working-dir", str(tmp_path / "imgs")]
    assert "outside the working dir" in _error_line(capsys, outside)
    missing = ["submit", str(run_config), "--working-dir", str(tmp_path / "nope")]
    assert "is not a directory" in _error_line(capsys, missing)
    url = f"http://127.0.0.1:{_free_port()}"
    token = ["submit", str(run_config), "--address", url, "--token-file", str(tmp_path / "t")]
    assert "token file" in _error_line(capsys, [*token, "--working-dir", str(tmp_path)])


def test_no_traceback_from_the_real_command(tmp_path):
    """The installed entry point, end to end: an unreachable head and a malformed config."""
    _write(tmp_path / "run.yaml", "data:\n  source: .\n")
    done = _raypipe(
        "submit",
        "run.yaml",
        "--address",
        f"127.0.0.1:{_free_port()}",
        "--working-dir",
        ".",
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("raypipe submit: error: cannot reach a Ray job API")
    _write(tmp_path / "bad.yaml", "data: {source: [\n")
    done = _raypipe("run", "bad.yaml", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_unknown_arguments_and_missing_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "x.yaml", "--nope", "3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2


def test_bench_passes_arguments_through(monkeypatch, tmp_path, capfd):
    script = _write(tmp_path / "ingest.py", "import sys\nprint('ARGS', sys.argv[1:])\n")
    monkeypatch.setattr(cli, "BENCH_SCRIPT", script)
    assert cli.main(["bench", "--", "--size", "small", "--epochs", "1"]) == 0
    assert "ARGS ['--size', 'small', '--epochs', '1']" in capfd.readouterr().out


def test_bench_says_when_the_script_is_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "benchmarks" / "ingest.py")
    assert "ingest.py not found" in _error_line(capsys, ["bench"])


def test_job_address_defaults(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_address(None) == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:9999/")
    assert job_address(None) == "http://127.0.0.1:9999"
    assert job_address("127.0.0.1:8266") == "http://127.0.0.1:8266"


def test_entrypoint_runs_the_config_from_the_working_dir(tmp_path, run_config):
    command, kind = entrypoint(run_config, tmp_path, Path("/data/here"))
    assert kind == "train"
    assert command == "python -m raypipe run run.yaml --data-root /data/here"


def test_a_resumed_jobs_run_folder_is_the_heads(tmp_path, run_config):
    command, _ = entrypoint(run_config, tmp_path, Path("/data/here"), resume="runs/r1")
    assert command.endswith("--data-root /data/here --resume /data/here/runs/r1")
    command, _ = entrypoint(run_config, tmp_path, Path("/d"), resume="/shared/runs/r1")
    assert command.endswith("--resume /shared/runs/r1")
    shards = _write(tmp_path / "shards.yaml", "preprocess:\n  source: .\n  out: o\n")
    with pytest.raises(
        ValueError, match="--resume goes on with a training run; .* a convert config"
    ):
        entrypoint(shards, tmp_path, Path("/d"), resume="runs/r1")


def test_a_config_a_gitignore_leaves_out_is_refused_before_it_is_sent(tmp_path, run_config,
                                                                      monkeypatch):  # fmt: skip
    """Ray's upload honours the working dir's .gitignore files, and raypipe's own excludes:
    such a config passed the check here, and the job then failed on the head (no such
    file). A rule that puts a file back (!keep.yaml) ships it."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    _write(tmp_path / "local" / ".gitignore", "*.yaml\n!keep.yaml\n")
    hidden, kept = tmp_path / "local" / "run.yaml", tmp_path / "local" / "keep.yaml"
    for path in (hidden, kept, tmp_path / "demo-data" / "run.yaml"):
        _write(path, run_config.read_text())
    with pytest.raises(ValueError, match=r"would not be shipped .*: local/\.gitignore:1:\*\.yaml "):
        entrypoint(hidden, tmp_path, Path("/data"))
    with pytest.raises(ValueError, match=r"raypipe's excludes \(demo-data/: "):
        entrypoint(tmp_path / "demo-data" / "run.yaml", tmp_path, Path("/data"))
    entrypoint(kept, tmp_path, Path("/data"))  # put back by its rule
    entrypoint(run_config, tmp_path, Path("/data"))  # the one beside it ships
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")  # Ray then ships it too
    entrypoint(hidden, tmp_path, Path("/data"))


def test_a_loopback_heads_job_runs_this_python_where_the_head_has_it(tmp_path, run_config):
    """A loopback URL can be a tunnel to a head elsewhere (`ray dashboard`, ssh -L): this
    machine's interpreter path, sent as the command, was not found there."""
    stubs = tmp_path / "bin"
    for name in ("python", "here-python"):
        _write(stubs / name, f'#!/bin/sh\necho {name} "$@"\n').chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin"}
    for python, ran in ((stubs / "here-python", "here-python"), (tmp_path / "gone", "python")):
        command, _ = entrypoint(run_config, tmp_path, Path("/d"), python=str(python))
        out = subprocess.run(command, shell=True, env=env, capture_output=True, text=True).stdout
        assert out == f"{ran} -m raypipe run run.yaml --data-root /d\n", (command, out)


def test_relative_paths_resolve_against_the_data_root(tmp_path):
    cfg = _write(
        tmp_path / "c.yaml",
        """
        data: {source: [a/train, /abs/b], cache: disk, cache_dir: cache}
        eval: {source: val, cache: disk, cache_dir: ~/cache}
        trainer: {storage_path: runs}
        preprocess: {source: imgs, out: s3://bucket/x}
        """,
    )
    raw = jobspec.resolve_paths(cfg, "/root/dir")
    assert raw["data"]["source"] == ["/root/dir/a/train", "/abs/b"]
    assert raw["eval"]["source"] == "/root/dir/val"
    assert raw["data"]["cache_dir"] == "/root/dir/cache"  # a disk cache is a path too
    assert raw["eval"]["cache_dir"] == os.path.expanduser("~/cache")
    assert raw["trainer"]["storage_path"] == "/root/dir/runs"
    assert raw["preprocess"] == {"source": "/root/dir/imgs", "out": "s3://bucket/x"}


def test_submit_to_something_that_is_not_a_ray_head(capsys, run_config, tmp_path):
    """A wrong address that answers HTTP (here: 404 to everything) is named as such."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = ["submit", str(run_config), "--address", url, "--working-dir", str(tmp_path)]
        line = _error_line(capsys, argv)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert f"the job API at {url} failed: Version check returned 404" in line


@pytest.mark.parametrize(
    ("trainer", "said"),
    [("lr: fast", "trainer.lr='fast' must be a number > 0"),
     ("epochs: 0", "trainer.epochs=0 must be an integer >= 1"),
     ("use_gpu: 'no'", "trainer.use_gpu='no' must be true or false"),
     ("cpus_per_worker: -1", "trainer.cpus_per_worker=-1 must be a number > 0"),
     ("max_failures: 1.5", "trainer.max_failures=1.5 must be an integer >= -1")],
)  # fmt: skip
def test_bad_trainer_settings_are_one_line_before_ray(capsys, tmp_path, folder, trainer, said):
    """They reached the Train workers: 55 lines of their tracebacks after Ray's start."""
    cfg = _write(tmp_path / "t.yaml", f"data:\n  source: {folder}\ntrainer:\n  {trainer}\n")
    assert said in _error_line(capsys, ["run", str(cfg)])
    cfg = _write(tmp_path / "s.yaml", f"data:\n  source: {folder}\ntrainer: 5\n")
    assert "trainer must be a mapping of settings, not 5" in _error_line(capsys, ["run", str(cfg)])


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["run", "c.yaml", "--epochs", "0"], "argument --epochs: 0 is below 1"),
     (["demo-data", "d", "--photos", "-3"], "argument --photos: -3 is below 0"),
     (["demo-data", "d", "--seed", "-1"], "argument --seed: -1 is below 0"),
     (["inspect", "d", "--samples", "x"], "argument --samples: 'x' is not an integer")],
)  # fmt: skip
def test_counts_on_the_command_line_are_checked(capsys, monkeypatch, tmp_path, argv, said):
    """`--epochs 0` trained the config's epochs and `--photos -3` wrote "-3 JPEGs"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_an_output_folder_that_cannot_be_made_is_one_line(capsys, tmp_path, folder, run_config):
    """Through a file: a traceback (demo-data), or one from pyarrow after Ray's start."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert "Not a directory" in _error_line(capsys, ["demo-data", str(blocker / "d")])
    line = _error_line(capsys, ["run", str(run_config), "--storage-path", str(blocker / "runs")])
    assert "Not a directory" in line and str(blocker) in line
    cfg = _write(tmp_path / "p.yaml", f"convert:\n  source: {folder}\n  out: {blocker}/out\n")
    assert "Not a directory" in _error_line(capsys, ["convert", str(cfg)])


def test_convert_refuses_a_glob_source_and_a_foreign_out_before_ray(capsys, monkeypatch, tmp_path):
    """A glob source skipped the out-inside-source check (the shards' folder became one
    more class); an out holding other files was refused only after Ray had started."""
    root = make_imagefolder(tmp_path / "digits" / "train", {"a": 3, "b": 3}, seed=1)

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the folders were checked")

    monkeypatch.setattr(cli, "_ray_session", no_ray)
    glob = _write(tmp_path / "g.yaml", f"convert:\n  source: {tmp_path}/digits/tr*\n"
                  f"  out: {root}/zz-shards\n")  # fmt: skip
    assert "must be one image folder (the folder of the class folders), not a glob" in (
        _error_line(capsys, ["convert", str(glob)])
    )
    missing = _write(tmp_path / "m.yaml", f"convert:\n  source: {tmp_path}/set[2]\n  out: o\n")
    assert "matches nothing" in _error_line(capsys, ["convert", str(missing)])  # not "a glob"
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00000-of-00001.parquet").write_bytes(b"another dataset")
    foreign = _write(tmp_path / "f.yaml", f"convert:\n  source: {root}\n  out: {out}\n")
    assert "holds files and no index.json of a convert" in _error_line(
        capsys, ["convert", str(foreign)]
    )


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
def test_a_heads_ipv6_address_in_brackets_is_reached():
    """``[::1]:PORT``, as Ray spells an IPv6 GCS address, was refused as nothing answering."""
    from raypipe.cli.app import _check_head

    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with listener:
        _check_head(f"[::1]:{listener.getsockname()[1]}")  # raised ConnectionError


def test_an_image_folder_given_as_files_is_named_briefly(capsys, folder):
    """A glob of 1,438 files was one 30 KB line naming every one."""
    line = _error_line(capsys, ["inspect", f"{folder}/*/*"])
    assert "is one directory (the folder of the class folders), got 5 path(s)" in line
    assert line.count(str(folder)) == 3 and len(line) < 600


def test_run_with_an_address_nothing_answers_on_is_one_line(capsys, run_config):
    """Ray retried 127.0.0.1:1 for minutes; a dashboard URL got Ray's RAY_ADDRESS advice."""
    line = _error_line(capsys, ["run", str(run_config), "--address", f"127.0.0.1:{_free_port()}"])
    assert "cannot reach Ray: nothing answers at 127.0.0.1:" in line and "GCS address" in line
    line = _error_line(capsys, ["run", str(run_config), "--address", "http://127.0.0.1:8265"])
    assert "an http:// address is the dashboard's, for raypipe submit" in line
    line = _error_line(capsys, ["run", str(run_config), "--address", "127.0.0.1"])
    assert "is host:port (its port, 6379 by default, is missing)" in line  # an int's error


def test_the_console_script_imports_a_transform_from_the_current_folder(tmp_path, run_config):
    """`python -m raypipe` finds ``myaug.py`` in the current folder (and Ray's workers do,
    from the driver's); the ``raypipe`` script refused it: "cannot import it"."""
    (tmp_path / "myaug.py").write_text("def augment(sample):\n    return sample\n")
    cfg = tmp_path / "aug.yaml"
    cfg.write_text(
        run_config.read_text().replace("data:\n", "data:\n  transform: myaug:augment\n", 1)
    )
    bin_dir = Path(sys.executable).parent
    done = subprocess.run([str(bin_dir / "raypipe"), "run", str(cfg), "--address", "127.0.0.1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "cannot import" not in done.stderr, done.stderr
    assert "its port, 6379 by default, is missing" in done.stderr  # checked after the config


def test_resume_names_a_missing_folder_before_ray(capsys, run_config, tmp_path):
    line = _error_line(capsys, ["run", str(run_config), "--resume", str(tmp_path / "nope")])
    assert "--resume" in line and "no such folder" in line


@pytest.mark.slow
def test_a_run_goes_on_from_the_folder_its_checkpoints_are_in(ray_session, capsys, run_config,
                                                             tmp_path):  # fmt: skip
    """`raypipe run` could not resume: a stopped run (Ctrl-C, a lost head) started again
    from epoch 0. ``--resume`` goes on from a run folder's latest checkpoint, and what a
    stopped run says (`go_on`) is that command, where it saved a checkpoint."""
    from raypipe.cli.classify import go_on
    from raypipe.train.checkpoint import latest_state

    runs = tmp_path / "runs"
    assert cli.main(["run", str(run_config), "--storage-path", str(runs)]) == 0
    [first] = [p for p in runs.iterdir() if p.is_dir()]
    assert latest_state(str(first)).epoch == 1  # its one epoch, done
    words = ["raypipe", "run", "my run.yaml", "--epochs", "3"]
    said = f"go on with: raypipe run 'my run.yaml' --epochs 3 --resume {first}"
    assert go_on(words, str(first)) == said
    assert go_on(words, str(tmp_path)) == "the run stopped before its first checkpoint"
    args = cli.build_parser().parse_args(["run", "r.yaml", "--epochs", "3", "--data-root", "d"])
    assert cli._run_words(args) == ["raypipe", "run", "r.yaml", "--epochs", "3", "--data-root", "d"]
    capsys.readouterr()
    argv = ["run", str(run_config), "--storage-path", str(runs), "--resume", str(first)]
    assert cli.main([*argv, "--epochs", "3"]) == 0
    [second] = [p for p in runs.iterdir() if p.is_dir() and p != first]
    assert latest_state(str(second)).epoch == 3 and "checkpoint" in capsys.readouterr().out
    line = _error_line(capsys, [*argv, "--epochs", "1"])  # nothing left to train
    assert "epoch 1" in line and "epochs=1" in line, line


def test_demo_data_run_again_replaces_what_it_wrote_and_refuses_other_files(capsys, tmp_path):
    """Another seed into the same folder left the first split's files beside the second's:
    576 digits in both train and val, and counts on disk that were not the ones printed."""

    def on_disk(out: Path) -> tuple[dict[str, set[str]], int]:
        digits = out / "digits"
        splits = {s: {p.name for p in (digits / s).rglob("*.png")} for s in ("train", "val")}
        return splits, len(list((out / "photos").rglob("*.jpg")))

    out = tmp_path / "demo"
    assert cli.main(["demo-data", str(out), "--photos", "6"]) == 0
    assert cli.main(["demo-data", str(out), "--photos", "4", "--seed", "1"]) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    splits, photos = on_disk(out)
    assert said == (f"wrote {out}/digits (train {len(splits['train'])}, val "
                    f"{len(splits['val'])}) and {out}/photos ({photos} JPEGs)")  # fmt: skip
    assert photos == 4 and len(splits["train"]) + len(splits["val"]) == 1797
    assert not splits["train"] & splits["val"]
    mine = tmp_path / "mine"
    _write(mine / "photos" / "notes.txt", "keep me")
    err = _error_line(capsys, ["demo-data", str(mine)])
    assert "holds files demo-data did not write" in err and (mine / "photos/notes.txt").exists()
