"""The ``raypipe`` command line (also ``python -m raypipe``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from raypipe.cli import jobspec
from raypipe.config import FORMATS

BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ingest.py"


def _demo_data(args: argparse.Namespace) -> int:
    from raypipe.cli.demo import write_demo_data

    counts = write_demo_data(args.out, photos=args.photos, seed=args.seed)
    print(
        f"wrote {args.out}/digits (train {counts['train']}, val {counts['val']}) "
        f"and {args.out}/photos ({counts['photos']} JPEGs)"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    import ray

    from raypipe.cli.classify import RunConfig, run
    from raypipe.data.shards import list_shards

    _expect_kind(args.config, "train")
    with tempfile.TemporaryDirectory(prefix="raypipe-") as tmp:
        config = jobspec.write_resolved(args.config, args.data_root, tmp)
        cfg = RunConfig.from_yaml(config)  # fail on bad data paths before starting Ray
        for section in (cfg.data, cfg.eval):
            if section is not None:
                list_shards(section)
        started = not ray.is_initialized()
        if started:
            ray.init(
                address=_ray_address(args.address), log_to_driver=True, configure_logging=False
            )
        t0 = time.perf_counter()
        try:
            storage = args.storage_path and jobspec.resolve(args.data_root, args.storage_path)
            result = run(config, epochs=args.epochs, storage_path=storage)
        finally:
            if started:
                ray.shutdown()
    m = result.metrics or {}
    rows = [("time", f"{time.perf_counter() - t0:.1f} s")]
    if "samples" in m:
        rows.append(("samples", f"{int(m['samples'])} in the last epoch, all ranks"))
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


def _convert(args: argparse.Namespace) -> int:
    import ray

    from raypipe.cli.convert import ShardsConfig, convert, plan

    _expect_kind(args.config, "convert")
    raw = jobspec.resolve_paths(args.config, args.data_root)
    cfg = ShardsConfig.from_dict(raw[jobspec.convert_section(raw)])
    plan(cfg)  # fail on a bad folder before starting Ray
    started = not ray.is_initialized()
    if started:
        ray.init(address=_ray_address(args.address), log_to_driver=True, configure_logging=False)
    try:
        s = convert(cfg)
    finally:
        if started:
            ray.shutdown()
    _summary(
        "convert",
        [
            ("shards", f"{s.shards} in {s.out} ({s.written} written, {s.reused} already done)"),
            ("samples", str(s.samples)),
            ("samples/s", f"{s.samples_per_s:.1f}"),
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
        image_column=args.image_column, label_column=args.label_column,
        label_member=args.label_member, label_key=args.label_key,
    )  # fmt: skip
    report = survey(config, samples=args.samples)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _summary(f"inspect {args.source}", format_survey(report), done=False)
    if report["good"] == 0:
        print("raypipe inspect: every sample looked at would be skipped: check the format and "
              "the label settings above", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _key_value(text: str) -> tuple[str, object]:
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--storage-option {text!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)


def _submit(args: argparse.Namespace) -> int:
    from raypipe.cli.submit import submit

    return submit(
        args.config,
        address=args.address,
        working_dir=args.working_dir,
        wait=not args.no_wait,
        token_file=args.token_file,
        submission_id=args.submission_id,
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


def _expect_kind(config: str, kind: str) -> None:
    found = jobspec.check(config)
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


def _add_ray_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (default: RAY_ADDRESS, else start a local Ray)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raypipe",
        description="Elastic Ray Data preprocessing for PyTorch DDP training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo-data", help="write the demo datasets (digits, photos)",
                       description="Write digits image folders (train/val) and photo JPEGs, "
                       "made from data scikit-learn ships; nothing is downloaded.")  # fmt: skip
    p.add_argument(
        "out", nargs="?", default="demo-data", help="output folder (default: %(default)s)"
    )
    p.add_argument(
        "--photos", type=int, default=512, help="photo JPEGs to write (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="split and crop seed (default: %(default)s)")
    p.set_defaults(func=_demo_data)

    p = sub.add_parser("run", help="train from a run config on Ray (local by default)",
                       description="Train the classifier job of a run config (data, eval, "
                       "trainer sections) with DDP on Ray Train.")  # fmt: skip
    p.add_argument("config", help="run config YAML, e.g. jobs/configs/digits.yaml")
    _add_ray_address(p)
    p.add_argument("--epochs", type=int, default=None, help="override trainer.epochs")
    p.add_argument("--storage-path", default=None, help="override trainer.storage_path")
    p.add_argument("--data-root", default=".",
                   help="resolve relative data paths in the config against this folder "
                   "(default: the current one; raypipe submit passes yours)")  # fmt: skip
    p.set_defaults(func=_run)

    p = sub.add_parser("convert", aliases=["preprocess"],
                       help="turn an image folder into WebDataset or Parquet shards",
                       description="Write the image folder of a convert config as shards "
                       "named like train-00003-of-00016.tar (or .parquet) with Ray tasks, plus "
                       "index.json with per-shard sample counts. Shards already finished by an "
                       "earlier run are kept; each new shard is read back and checked.")  # fmt: skip
    p.add_argument("config", help="convert config YAML, e.g. jobs/configs/digits-shards.yaml "
                   "(`raypipe preprocess`, its 0.1 name, still works)")  # fmt: skip
    _add_ray_address(p)
    p.add_argument("--data-root", default=".",
                   help="resolve relative paths in the config against this folder "
                   "(default: the current one)")  # fmt: skip
    p.set_defaults(func=_convert)

    p = sub.add_parser("inspect", help="show what raypipe reads from a source",
                       description="List a source as a run would (format, shards, samples, "
                       "classes, where labels come from) and decode a few samples spread over "
                       "its shards as the actors would, without Ray: their sizes, labels and "
                       "why any would be skipped. Exit code 1 when every one would be.")  # fmt: skip
    p.add_argument("source", help="folder, glob, file or URI (s3://bucket/prefix/, gs://...)")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="the source's format (default: inferred from file names)")  # fmt: skip
    p.add_argument(
        "--samples", type=int, default=32, help="samples to decode (default: %(default)s)"
    )
    for flag, default, what in (("--image-column", "image", "Parquet image column"),
                                ("--label-column", "label", "Parquet label column"),
                                ("--label-key", "label", "key of the label in .json")):  # fmt: skip
        p.add_argument(flag, default=default, help=f"{what} (default: %(default)s)")
    p.add_argument("--label-member", default=None,
                   help="WebDataset label member: cls, txt or json (default: the first present)")  # fmt: skip
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a storage_options setting, e.g. endpoint_url=http://127.0.0.1:9000 "
                   "(repeatable)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("submit", help="submit a run or convert config as a Ray job",
                       description="Submit a config to a Ray head as a Ray job: the working dir "
                       "is shipped with it, the job's log is streamed here, and the exit code "
                       "is the job's outcome (0 when it SUCCEEDED).")  # fmt: skip
    p.add_argument("config", help="run or convert config YAML inside the working dir")
    p.add_argument("--address", default=None,
                   help="the head's job API (dashboard) URL (default: RAY_ADDRESS, "
                   "else http://127.0.0.1:8265)")  # fmt: skip
    p.add_argument("--no-wait", action="store_true",
                   help="return once the job is submitted instead of following it")  # fmt: skip
    p.add_argument("--working-dir", default=None,
                   help="folder shipped with the job (default: the raypipe source checkout)")  # fmt: skip
    p.add_argument("--token-file", default=None,
                   help="file holding the head's auth token (token authentication); "
                   "default: Ray's own RAY_AUTH_MODE=token with RAY_AUTH_TOKEN(_PATH)")  # fmt: skip
    p.add_argument("--submission-id", default=None, help="job id to use (default: Ray picks)")
    p.set_defaults(func=_submit)

    p = sub.add_parser("bench", help="measure ingest throughput against torch DataLoader",
                       description="Run benchmarks/ingest.py of the source checkout; arguments "
                       "after `--` go to it unchanged, e.g. raypipe bench -- --size small.")  # fmt: skip
    p.set_defaults(func=_bench, bench_args=[])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from raypipe.cli.submit import SubmitError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench":
        args.bench_args = extra[1:] if extra[:1] == ["--"] else extra
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, SubmitError) as e:
        print(f"raypipe {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except ConnectionError as e:
        print(f"raypipe {args.command}: error: cannot reach Ray: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raypipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
