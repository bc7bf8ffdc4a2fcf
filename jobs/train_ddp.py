"""Ray job entry point: train the classifier of a run config with DDP on Ray Train.

    raypipe submit jobs/configs/digits.yaml     # ships the checkout, resolves data paths here

or by Ray's own CLI, with the data at the same path on the head (``.gitignore``'d
``demo-data/`` is not shipped with the working dir):

    ray job submit --working-dir . -- python jobs/train_ddp.py jobs/configs/digits.yaml --data-root "$PWD"
"""

import sys

from raypipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
