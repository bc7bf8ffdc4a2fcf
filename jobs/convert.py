"""Ray job entry point: write an image folder as WebDataset or Parquet shards.

    raypipe submit jobs/configs/digits-shards.yaml     # ships the checkout, resolves data paths here

or by Ray's own CLI, with the data at the same path on the head (``.gitignore``'d
``demo-data/`` is not shipped with the working dir):

    ray job submit --working-dir . -- python jobs/convert.py jobs/configs/digits-shards.yaml --data-root "$PWD"
"""

import sys

from raypipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
