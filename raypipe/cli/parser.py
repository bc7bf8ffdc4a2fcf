"""The ``raypipe`` command line's commands and flags; `raypipe.cli.app` carries them out."""

from __future__ import annotations

import argparse

from raypipe.config import FORMATS

__all__ = ["build_parser"]
assert __all__ == sorted(__all__)


def _at_least(low: int):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _ray_address_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (default: RAY_ADDRESS, else start a local Ray)",
    )
    _verbose_flag(p)


def _verbose_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's own logs too (also RAYPIPE_VERBOSE=1); by default only "
                   "raypipe's lines and Ray's warnings and errors")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand; ``args.command`` names the one given (an alias as typed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("raypipe")
    except PackageNotFoundError:  # run from a source tree that pip did not install
        installed = "(not installed)"
    parser = argparse.ArgumentParser(
        prog="raypipe",
        description="Elastic Ray Data preprocessing for PyTorch DDP training.",
        epilog="examples:\n  raypipe demo-data\n  raypipe inspect demo-data/digits/train\n"
        "  raypipe run jobs/configs/digits.yaml --epochs 1\n"
        "  raypipe submit jobs/configs/digits.yaml --address http://127.0.0.1:8265",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"raypipe {installed}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo-data", help="write the demo datasets (digits, photos)",
                       description="Write digits image folders (train/val) and photo JPEGs, "
                       "made from data scikit-learn ships; nothing is downloaded.")  # fmt: skip
    p.add_argument(
        "out", nargs="?", default="demo-data", help="output folder (default: %(default)s)"
    )
    p.add_argument(
        "--photos",
        type=_at_least(0),
        default=512,
        help="photo JPEGs to write (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=_at_least(0), default=0, help="split and crop seed (default: %(default)s)"
    )

    p = sub.add_parser("run", help="train from a run config on Ray (local by default)",
                       description="Train the classifier job of a run config (data, eval, "
                       "trainer sections) with DDP on Ray Train.")  # fmt: skip
    p.add_argument("config", help="run config YAML, e.g. jobs/configs/digits.yaml")
    _ray_address_flag(p)
    p.add_argument("--epochs", type=_at_least(1), default=None, help="override trainer.epochs")
    p.add_argument("--storage-path", default=None, help="override trainer.storage_path")
    p.add_argument("--resume", metavar="RUN", default=None,
                   help="go on from a run folder (its latest checkpoint) or a checkpoint "
                   "folder that a run of this config saved: the rest of that epoch, then "
                   "the epochs left; a stopped run prints the command")  # fmt: skip
    p.add_argument("--data-root", default=".",
                   help="resolve relative data paths in the config against this folder "
                   "(default: the current one; raypipe submit passes yours)")  # fmt: skip

    p = sub.add_parser("convert", aliases=["preprocess"],
                       help="turn an image folder into WebDataset, Parquet or TFRecord shards",
                       description="Write the image folder of a convert config as shards "
                       "named like train-00003-of-00016.tar (or .parquet, .tfrecord) with Ray tasks, plus "
                       "index.json with per-shard sample counts. Shards already finished by an "
                       "earlier run are kept; each new shard is read back and checked.")  # fmt: skip
    p.add_argument("config", help="convert config YAML, e.g. jobs/configs/digits-shards.yaml "
                   "(`raypipe preprocess`, its 0.1 name, still works)")  # fmt: skip
    _ray_address_flag(p)
    p.add_argument("--data-root", default=".",
                   help="resolve relative paths in the config against this folder "
                   "(default: the current one)")  # fmt: skip

    p = sub.add_parser("inspect", help="show what raypipe reads from a source",
                       description="List a source as a run would (format, shards, samples, "
                       "classes, where labels come from) and decode a few samples spread over "
                       "its shards as the actors would, without Ray: their sizes, labels and "
                       "why any would be skipped. Exit code 1 when every one would be.")  # fmt: skip
    p.add_argument("source", help="folder, glob, file or URI (s3://bucket/prefix/, gs://...)")
    p.add_argument("--format", default=None, choices=FORMATS,
                   help="the source's format (default: inferred from file names)")  # fmt: skip
    p.add_argument(
        "--samples", type=_at_least(1), default=32, help="samples to decode (default: %(default)s)"
    )
    for flag, default, what in (("--image-column", "image", "Parquet column, TFRecord feature, LMDB key or HDF5 dataset of the image; none: samples with no image"),
                                ("--label-column", "label", "the same, of the label"),
                                ("--label-key", "label", "key of the label in .json")):  # fmt: skip
        p.add_argument(flag, default=default, help=f"{what} (default: %(default)s)")
    p.add_argument("--label-member", default=None,
                   help="WebDataset label member: cls, txt or json (default: the first present)")  # fmt: skip
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a storage_options setting, e.g. endpoint_url=http://127.0.0.1:9000 "
                   "(repeatable; VALUE is read as JSON where it is JSON, e.g. anonymous=true, "
                   "else kept as written)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("submit", help="submit a run or convert config as a Ray job",
                       description="Submit a config to a Ray head as a Ray job: the working dir "
                       "is shipped with it, the job's log is streamed here, and the exit code "
                       "is the job's outcome: 0 when it SUCCEEDED, 1 when it FAILED or was "
                       "STOPPED, 2 when it could not be submitted, 3 when it was submitted but "
                       "its end was not seen here (its log stream kept closing or was lost; see: "
                       "ray job status ID), 130 when you stopped following it (Ctrl-C; the job "
                       "goes on). Relative data paths in the config are resolved against "
                       "--data-root, which the head must see at the same path.")  # fmt: skip
    p.add_argument("config", help="run or convert config YAML inside the working dir")
    p.add_argument("--address", default=None,
                   help="the head's job API (dashboard) URL, not its GCS address (default: "
                   "RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else http://127.0.0.1:8265)")  # fmt: skip
    p.add_argument("--no-wait", action="store_true",
                   help="return once the job is submitted instead of following it")  # fmt: skip
    p.add_argument("--working-dir", default=None,
                   help="folder shipped with the job, less environments, data and secrets "
                   "(.venv, .env, keys, credentials; default: the raypipe source checkout)")  # fmt: skip
    p.add_argument("--data-root", default=".",
                   help="resolve relative data paths in the config against this folder, as "
                   "the head sees it (default: the current one)")  # fmt: skip
    p.add_argument("--token-file", default=None,
                   help="file holding the head's auth token (token authentication); "
                   "default: with RAY_AUTH_MODE=token, Ray's RAY_AUTH_TOKEN(_PATH) or "
                   "~/.ray/auth_token; with RAY_AUTH_MODE unset, the token Ray finds here, "
                   "sent only to a head on this machine (a loopback address)")  # fmt: skip
    p.add_argument("--submission-id", default=None,
                   help="job id to use (default: raypipe_{train|convert}_ and 12 random hex "
                   "digits)")  # fmt: skip
    p.add_argument("--resume", metavar="RUN", default=None,
                   help="a run config's job goes on from this run folder on the head (as "
                   "raypipe run --resume; a relative one is resolved against --data-root)")  # fmt: skip
    _verbose_flag(p)

    p = sub.add_parser("bench", help="measure ingest throughput against torch DataLoader",
                       usage="raypipe bench [-h] [-- ARGS]",
                       description="Run benchmarks/ingest.py of the source checkout; arguments "
                       "after `--` go to it unchanged, e.g. raypipe bench -- --size small.")  # fmt: skip
    p.set_defaults(bench_args=[])
    return parser
