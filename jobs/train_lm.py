"""Ray job entry point: a small causal language model trained by DDP on packed tokens.

    python jobs/train_lm.py --make-data demo-data/tokens
    python jobs/train_lm.py jobs/configs/tokens-lm.yaml    # on a local Ray

As a Ray job (``ray job submit --working-dir . -- python jobs/train_lm.py CONFIG``) the
config's data paths must name where the head sees the data: relative ones are read in the
job's copy of the working dir, which ``.gitignore``'d ``demo-data/`` is not shipped into.
"""

import argparse
import os
import sys

from raypipe import localnode
from raypipe.cli import localray
from raypipe.cli.causal_lm import LMConfig, make_tokens, run
from raypipe.loader.errors import data_errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="a language-model config (YAML)")
    parser.add_argument("--make-data", metavar="DIR", help="write the demo corpus to DIR")
    parser.add_argument("--epochs", type=int, help="override trainer.epochs")
    args = parser.parse_args(argv)
    if not (args.config or args.make_data):
        parser.error("give a config to train from, or --make-data DIR")
    if args.config and not os.path.isfile(args.config):
        parser.error(f"config {args.config!r} not found")
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: must be >= 1")
    if args.make_data:
        print(f"wrote {make_tokens(args.make_data)}")
    if args.config:
        try:
            result = _train(args.config, args.epochs)
        except (ValueError, *data_errors()) as e:  # a config or its data refused: one line
            print(f"train_lm: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        m = result.metrics
        print(f"loss {m['first_loss']:.3f} → {m['loss']:.3f} over {m['epoch'] + 1} epochs, "
              f"{m['tokens_per_s']:.0f} tokens/s")  # fmt: skip
    return 0


def _train(config: str, epochs: int | None):
    """`run` on this process's Ray, else on one started here and stopped after, every
    process of it (`raypipe.cli.localray.shutdown`), as ``raypipe run`` does."""
    import ray

    LMConfig.from_yaml(config)  # a bad config fails here, in one line, before Ray starts
    started = not ray.is_initialized()
    localnode.ensure()
    try:
        return run(config, epochs=epochs)
    finally:
        if started:
            localray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
