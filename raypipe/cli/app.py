"""The ``raypipe`` command line (also ``python -m raypipe``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from raypipe.cli import jobspec, localray, quiet
from raypipe.cli.parser import build_parser

BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ingest.py"


def _demo_data(args: argparse.Namespace) -> int:
    from raypipe.cli.demo import write_demo_data

    counts = write_demo_data(args.out, photos=args.photos, seed=args.seed)
    print(
        f"wrote {args.out}/digits (train {counts['train']}, val {counts['val']}) "
        f"and {args.out}/photos ({counts['photos']} JPEGs)"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    from raypipe.cli.classify import RunConfig, check_classes, go_on, run
    from raypipe.train.checkpoint import new_run_name, run_folder

    _expect_kind(args.config, "train", args.data_root)
    jobspec.check_sources(args.config, args.data_root)
    with tempfile.TemporaryDirectory(prefix="raypipe-") as tmp:
        config = jobspec.write_resolved(args.config, args.data_root, tmp)
        run_cfg = RunConfig.from_yaml(config)
        classes = check_classes(run_cfg, args.config)  # before Ray
        storage = args.storage_path and jobspec.resolve(args.data_root, args.storage_path)
        setting = "--storage-path" if storage else f"{args.config}: trainer.storage_path"
        jobspec.make_folder(storage or run_cfg.trainer.storage_path, setting)
        resume = args.resume and _resumable(jobspec.resolve(".", args.resume))
        verbose = quiet.is_verbose(args.verbose)
        name = new_run_name()  # train_ddp would pick one; known here, for a stop's go-on line
        with _ray_session(args.address, verbose=verbose):
            t0 = time.perf_counter()  # the run's time, not Ray's start-up
            try:
                result = run(config, epochs=args.epochs, storage_path=storage, classes=classes,
                             ray_log_level="INFO" if verbose else quiet.TRAIN_LOG_LEVEL,
                             name=name, resume_from=resume)  # fmt: skip
            except KeyboardInterrupt:
                folder = run_folder(storage or run_cfg.trainer.storage_path, name)
                raise KeyboardInterrupt(go_on(_run_words(args), folder)) from None
    m = result.metrics or {}
    rows = [("time", f"{time.perf_counter() - t0:.1f} s")]
    if "samples" in m:
        left = (m.get("dataset_samples") or 0) - int(m["samples"]) - int(m.get("skipped", 0))
        by_drop = f" ({left} left out by drop_last: equal full batches)" if left > 0 else ""
        rows.append(("samples", f"{int(m['samples'])} in the last epoch, all ranks{by_drop}"))
    if "samples_per_s" in m:
        rows.append(("samples/s", f"{m['samples_per_s']:.1f}"))
    if "wait_fraction" in m:
        rows.append(("wait", f"{m['wait_fraction']:.1%} of the training loop's time"))
    if "skipped" in m:
        rows.append(("skipped", f"{int(m['skipped'])} bad samples in the last epoch"))
    rows += [(k, _num(m[k])) for k in ("loss", "val_accuracy") if k in m]
    if result.checkpoint is not None:
        rows.append(("checkpoint", result.checkpoint.path))
    _summary("run", rows)
    return 0


def _run_words(args: argparse.Namespace) -> list[str]:
    """The ``raypipe run`` command as given, less ``--resume`` and ``--verbose``."""
    words = ["raypipe", "run", args.config]
    for flag, value in (("--epochs", args.epochs), ("--storage-path", args.storage_path),
                        ("--address", args.address)):  # fmt: skip
        words += [flag, str(value)] if value is not None else []
    return words + (["--data-root", args.data_root] if args.data_root != "." else [])


def _resumable(path: str) -> str:
    """``--resume``'s folder, checked before Ray starts (train_ddp checks what it holds)."""
    if "://" not in path and not os.path.isdir(path):
        raise FileNotFoundError(f"--resume {path}: no such folder (a run folder, or one of "
                                "its checkpoint_* folders)")  # fmt: skip
    return path


def _convert(args: argparse.Namespace) -> int:
    from raypipe.cli.convert import ShardsConfig, check_out, convert

    _expect_kind(args.config, "convert", args.data_root)
    jobspec.check_sources(args.config, args.data_root)
    cfg = ShardsConfig.from_yaml(args.config, jobspec.resolve_paths(args.config, args.data_root))
    check_out(cfg)  # fail on a bad folder before starting Ray
    jobspec.make_folder(cfg.out, f"{args.config}: convert.out")
    with _ray_session(args.address, verbose=quiet.is_verbose(args.verbose)):
        s = convert(cfg)
    _summary(
        "convert",
        [
            ("shards", f"{s.shards} in {s.out} ({s.written} written, {s.reused} already done)"),
            ("samples", str(s.samples)),
            ("samples/s", f"{s.samples_per_s:.1f}" if s.written else "- (nothing to write)"),
            ("restart markers", s.markers),
            ("skipped", f"{len(s.skipped)}" + (" (listed above)" if s.skipped else "")),
            ("time", f"{s.seconds:.1f} s"),
        ],
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import json

    from raypipe.cli.survey import format_survey, survey
    from raypipe.config import PipelineConfig

    options = dict(_key_value(o) for o in args.storage_option) or None
    config = PipelineConfig(
        source=args.source, format=args.format, storage_options=options,
        image_column=None if args.image_column.lower() in ("none", "null") else args.image_column,
        label_column=args.label_column,
        label_member=args.label_member, label_key=args.label_key,
    )  # fmt: skip
    report = survey(config, samples=args.samples)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _summary(f"inspect {args.source}", format_survey(report), done=False)
    if report["good"] == 0:
        fix = (f"add {report['hint']}" if report["hint"]
               else "check the format and the label settings above")  # fmt: skip
        print(f"raypipe inspect: every sample looked at would be skipped: {fix}", file=sys.stderr)
        return 1
    return 0


def _key_value(text: str) -> tuple[str, object]:
    """``KEY=VALUE``, the value read as JSON where it is JSON (``true``, ``30``), else the
    string as written: a key or secret such as ``0777``, ``NO`` or ``a#b`` stays itself."""
    import json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--storage-option {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _submit(args: argparse.Namespace) -> int:
    from raypipe.cli.submit import submit

    return submit(
        args.config,
        address=args.address,
        working_dir=args.working_dir,
        data_root=args.data_root,
        wait=not args.no_wait,
        token_file=args.token_file,
        submission_id=args.submission_id,
        verbose=quiet.is_verbose(args.verbose),
        resume=args.resume,
    )


def _bench(args: argparse.Namespace) -> int:
    script = BENCH_SCRIPT
    if not script.is_file():
        raise ValueError(
            f"{script} not found: the benchmark ships with the source checkout, not the package"
        )
    return subprocess.call([sys.executable, str(script), *args.bench_args])


def _ray_address(address: str | None) -> str:
    """``--address``, else ``RAY_ADDRESS`` (set inside a Ray job), else a new local Ray.

    Plain ``ray.init()`` would join any cluster ``ray start`` left on this machine.
    """
    return address or os.environ.get("RAY_ADDRESS") or "local"


def _check_head(address: str) -> None:
    """A head's GCS address must answer before Ray is asked to join it (Ray retried an
    address nothing listened on for minutes)."""
    import socket

    if address in ("local", "auto") or address.startswith("ray://"):
        return
    if "://" in address:
        raise ValueError(f"address {address!r}: raypipe run joins a Ray head by its GCS "
                         "address (host:6379); an http:// address is the dashboard's, "
                         "for raypipe submit")  # fmt: skip
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:6379
    if not port.isdigit():
        raise ValueError(f"address {address!r}: a Ray head's GCS address is host:port "
                         "(its port, 6379 by default, is missing)")  # fmt: skip
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(
            f"nothing answers at {address} ({e}): is the head up (docs/jobs.md starts one "
            "on loopback), and is this its GCS address?"
        ) from None


@contextlib.contextmanager
def _ray_session(address: str | None, *, verbose: bool = False):
    """Ray at `_ray_address` for the block, unless this process already has one; a Ray
    started here is stopped at the end, every process of it (`raypipe.cli.localray`).
    Unless ``verbose``, Ray prints only what matters (`raypipe.cli.quiet`)."""
    import ray

    started = not ray.is_initialized()
    if started or address is not None:  # a head asked for by name answers, in every case
        address = _ray_address(address)
        _check_head(address)
    if started:
        if not verbose:
            quiet.quiet_ray(local=address == "local")
        localray.start(address, log_to_driver=True, configure_logging=False)
    try:
        if started and not verbose:
            quiet.filter_worker_logs()
        yield
    finally:
        if started:
            localray.shutdown()


def _expect_kind(config: str, kind: str, root: str) -> None:
    found = jobspec.check(config, root)
    if found != kind:
        use = "raypipe convert" if found == "convert" else "raypipe run"
        raise ValueError(f"{config} is a {found} config: use {use}")


def _num(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


def _summary(title: str, rows: list[tuple[str, str]], *, done: bool = True) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"raypipe {title}" + (": done" if done else ""))
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


COMMANDS = {"demo-data": _demo_data, "run": _run, "convert": _convert, "preprocess": _convert,
            "inspect": _inspect, "submit": _submit, "bench": _bench}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from raypipe.cli.jobapi import SubmitError
    from raypipe.loader.errors import data_errors

    if "" not in sys.path and os.getcwd() not in sys.path:  # a console script's: as
        sys.path.insert(0, os.getcwd())  # `python -m raypipe`, a transform's module here
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench":
        args.bench_args = extra[1:] if extra[:1] == ["--"] else extra
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, SubmitError, *data_errors()) as e:
        print(f"raypipe {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except ImportError as e:  # a format's library not installed: its message names the extra
        print(f"raypipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:
        print(f"raypipe {args.command}: error: cannot reach Ray: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder it cannot write, a path through a file
        print(f"raypipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        said = f": {e}" if str(e) else ""
        print(f"raypipe {args.command}: interrupted{said}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
