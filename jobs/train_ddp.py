"""Ray job entry point: train the classifier of a run config with DDP on Ray Train.

ray job submit --working-dir . -- python jobs/train_ddp.py jobs/configs/digits.yaml
"""

import sys

from raypipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
