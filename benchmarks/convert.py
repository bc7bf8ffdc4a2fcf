"""What restart markers cost ``raypipe convert``: the ingest corpus (``--images`` ~400×300
photo JPEGs, ``ingest.make_corpus``) written as 4 WebDataset shards with
``restart_markers`` on (each JPEG re-written losslessly) and off (its bytes copied),
alternating over ``--rounds`` rounds in one local Ray, the order flipping each round.

Reported: samples/s of each run (convert's own ``Summary``: the shards' tasks, listing and
index included), their medians, and the shards' bytes. Writes ``convert.json`` under --out.

    python benchmarks/convert.py [--images 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

from ingest import make_corpus

from raypipe.cli import localray
from raypipe.cli.convert import ShardsConfig, convert


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2048, help="(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    if args.images < 8 or args.rounds < 1:
        p.error("--images must be >= 8 and --rounds >= 1")
    corpus = make_corpus(args.out, args.images)
    # raypipe's own local Ray: every server on 127.0.0.1 (docs/security.md)
    localray.start("local", num_cpus=os.cpu_count(), include_dashboard=False,
                   log_to_driver=False, configure_logging=False)  # fmt: skip
    runs = []
    try:
        for r in range(args.rounds):
            for markers in (True, False) if r % 2 == 0 else (False, True):
                out = args.out / f"convert-{markers}"
                shutil.rmtree(out, ignore_errors=True)
                config = ShardsConfig(source=str(corpus), out=str(out), shards=4,
                                      restart_markers=markers)  # fmt: skip
                with open(os.devnull, "w") as quiet:
                    s = convert(config, log=quiet)
                size = sum(f.stat().st_size for f in out.glob("*.tar"))
                runs.append({"round": r, "restart_markers": markers, "restarted": s.restarted,
                             "samples_per_s": s.samples_per_s, "bytes": size})  # fmt: skip
                print(f"round {r + 1}: restart_markers={markers!s:<5} {s.samples_per_s:7.0f} "
                      f"samples/s, {size / 2**20:.1f} MiB", flush=True)  # fmt: skip
                shutil.rmtree(out, ignore_errors=True)
    finally:
        localray.shutdown()
    medians = {m: statistics.median(x["samples_per_s"] for x in runs if x["restart_markers"] is m)
               for m in (True, False)}  # fmt: skip
    print(
        f"median samples/s: restart markers {medians[True]:.0f}, bytes as they are "
        f"{medians[False]:.0f} ({medians[False] / medians[True]:.2f}x)"
    )
    result = {"images": args.images, "rounds": args.rounds, "runs": runs,
              "median_samples_per_s": {"restart_markers": medians[True], "off": medians[False]},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0]}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convert.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'convert.json'}")
    return result


if __name__ == "__main__":
    main()
