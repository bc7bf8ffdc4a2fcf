"""The ``raypipe`` command line (also ``python -m raypipe``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo_data(args: argparse.Namespace) -> int:
    from raypipe.demo import write_demo_data

    counts = write_demo_data(args.out, photos=args.photos, seed=args.seed)
    print(
        f"wrote {args.out}/digits (train {counts['train']}, val {counts['val']}) "
        f"and {args.out}/photos ({counts['photos']} JPEGs)"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    import ray

    from raypipe.classify import RunConfig, run

    RunConfig.from_yaml(args.config)  # fail on a bad config before starting Ray
    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address, log_to_driver=True, configure_logging=False)
    try:
        result = run(args.config, epochs=args.epochs, storage_path=args.storage_path)
    finally:
        if started:
            ray.shutdown()
    m = result.metrics or {}
    summary = ", ".join(
        f"{k} {m[k]:.4g}"
        for k in ("loss", "val_accuracy", "samples_per_s", "wait_fraction")
        if k in m
    )
    print(f"done: {summary}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint.path}")
    return 0


def _later(name: str, issue: str):
    def handler(args: argparse.Namespace) -> int:
        print(f"raypipe {name}: not available yet ({issue})", file=sys.stderr)
        return 2

    return handler


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
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, else start a local Ray)")  # fmt: skip
    p.add_argument("--epochs", type=int, default=None, help="override trainer.epochs")
    p.add_argument("--storage-path", default=None, help="override trainer.storage_path")
    p.set_defaults(func=_run)

    for name, text in (
        ("bench", "measure ingest throughput against torch DataLoader"),
        ("submit", "submit a run config as a Ray job to a Ray head"),
        ("preprocess", "turn an image folder into WebDataset or Parquet shards"),
    ):
        p = sub.add_parser(name, help=text, description=f"{text} (not available yet).")
        p.set_defaults(func=_later(name, "planned"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"raypipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raypipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
