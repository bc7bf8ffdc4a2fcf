"""Ray job entry point: write an image folder as WebDataset or Parquet shards.

ray job submit --working-dir . -- python jobs/convert.py jobs/configs/digits-shards.yaml
"""

import sys

from raypipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
