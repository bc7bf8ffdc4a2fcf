"""Where a cached sample's CPU goes: each step of the decoded cache timed alone, in one process.

For --images photos of a corpus (ingest.py's small one, or --photo WxH as cache.py makes
it), the steps a preprocessing worker runs per sample, each timed over all the photos
(``time.process_time``, one thread) and repeated for --rounds rounds, the steps in the
same order each round:

  uncached      read the file + `decode_crop` (the crop's region decoded, with DCT scaling
                where the crop allows, + random-resized-crop 224 + flip): every epoch
                without the cache
  epoch 0, cached:
    read          the file's bytes
    decode        `decode_capped` (the whole image, DCT-scaled and resized to the cap)
    check         the CRC32 of the capped pixels (`Entry.image`)
    write         `DiskStore.put` into a fresh /dev/shm directory, as a worker writes
                  (one file per sample, written, then placed and counted under the
                  usage file's lock, and mapped)
    write_floor   the same bytes into new files there with nothing around them (open,
                  one write, close): the kernel's part of ``write``, which no cache that
                  keeps its entries in shared memory avoids
    write_disk    `DiskStore.put` into a fresh directory under --disk, as ``cache="disk"``
                  writes (not mapped; the budget taken per entry): the epoch-0 cost of a
                  disk cache on that file system (--disk: the one under --out by default)
    crop          `crop_chw` from the capped pixels
  a later epoch, cached:
    own_first_touch  the writer's own entry met again: its pixels stay mapped since the
                  write (no read, no check), but the write went through the file, so each
                  page is mapped into the process on its first use (every page touched);
                  own_touch_again: the same once mapped
    first read    another process's entry met for the first time: open, map, check
    hit           an entry already mapped in this process
    crop          as above
  around every sample, cached or not:
    rows          the task's shard rows (`RankTasks.rows`, one-image shards, the
                  pipeline's tasks), per sample
    seed          `sample_rng(seed, epoch, key)`: NumPy's SeedSequence for one key
    plan          the crop plan drawn from a seeded generator
    plan_task     `sample_plan`: a key's seeding and plan in one call, compiled
                  (`_draws`) where it was built: what a worker runs, and the plans of
                  ``uncached`` and ``crop`` above (the same plans as ``seed`` + ``plan``)

Reported: the medians of the rounds in ms per image, and the ratios they imply for one
worker (uncached ÷ cached epoch 0, uncached ÷ hit + crop), which leave out what the
pipeline adds around them (the blocks' trip to the rank, the rank's batches). Then two
bounds on a cached epoch 0 against the uncached one: with only the kernel's write added
to reading, decoding the whole image and cropping it (``floor_write``), and with the
cache's own steps free (``floor_free``: read, decode, crop): any cache that keeps each
whole capped image pays at least these.

    python benchmarks/cache_parts.py [--images 256] [--rounds 5] [--photo 1600x1200] [--cap 320]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import cache as cache_bench
import ingest

from raypipe.plan.blocksize import MAX_FILES_PER_TASK
from raypipe.plan.rankplan import RankPlan
from raypipe.plan.ranktasks import RankTasks
from raypipe.plan.shards import list_shards
from raypipe.preprocess.augment import plan, sample_plan, sample_rng
from raypipe.preprocess.cache import entryfile, mapped
from raypipe.preprocess.cache.capped import decode_capped
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.store import Entry
from raypipe.preprocess.decode import crop_chw, decode_crop

IDENT = (1, 1)


def timed(fn, items) -> tuple[float, list]:
    """ms of CPU per item for ``fn`` over ``items``, and its results."""
    t = time.process_time()
    out = [fn(x) for x in items]
    return (time.process_time() - t) / len(items) * 1e3, out


def written(store: DiskStore, ids: list[str], entries: list[Entry]) -> float:
    """ms of CPU per entry to write ``entries`` into ``store`` as a worker's task does: each
    at once, the budget settled after."""
    t = time.process_time()
    for i, entry in zip(ids, entries, strict=True):
        store.put(i, entry)
    store.settle()
    return (time.process_time() - t) / len(ids) * 1e3


def touch(pixels) -> int:
    """One byte of every page of ``pixels`` read (a crop reads most of them)."""
    return int(pixels.reshape(-1)[::4096].sum())


def around(files: list[Path], tasks: RankTasks) -> dict[str, float]:
    """ms of CPU per sample for what a worker does around each sample's decode or crop."""
    r: dict[str, float] = {}
    t = time.process_time()
    got = [tasks.rows(task)[1] for task in range(len(tasks))]
    t = time.process_time() - t  # the samples counted outside the timing
    r["rows"] = t / sum(sum(g["num_samples"]) for g in got) * 1e3
    keys = list(range(len(files)))
    r["seed"], _ = timed(lambda k: sample_rng(ingest.SEED, 1, k), keys)
    gens = [sample_rng(ingest.SEED, 1, k) for k in keys]
    r["plan"], _ = timed(lambda g: plan(400, 300, train=True, rng=g, scale=(0.08, 1.0),
                                        ratio=(3 / 4, 4 / 3), flip=True), gens)  # fmt: skip
    r["plan_task"], _ = timed(lambda k: worker_plan(k)(400, 300), keys)
    return r


def worker_plan(key: int):
    """A worker's plan of ``key`` in epoch 1 (`ingest.chooser`'s, drawn as a worker does)."""
    return lambda w, h: sample_plan(ingest.SEED, 1, key, w, h, train=True, scale=(0.08, 1.0),
                                    ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip


def written_floor(root: Path, entries: list[Entry]) -> float:
    """ms of CPU per entry to put each entry's file bytes into a new file under ``root``
    with nothing else: the kernel's share of `written`."""
    files = [entryfile.parts(entry) for entry in entries]  # made before the timing
    t = time.process_time()
    for n, (head, body) in enumerate(files):
        fd = os.open(root / str(n), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, head)
            os.write(fd, body)
        finally:
            os.close(fd)
    return (time.process_time() - t) / len(files) * 1e3


def one_round(files: list[Path], shm: Path, disk: Path, cap: int, tasks: RankTasks) -> dict:
    r: dict[str, float] = around(files, tasks)
    keys = list(range(len(files)))
    r["uncached"], _ = timed(
        lambda k: decode_crop(files[k].read_bytes(), ingest.IMAGE, worker_plan(k)).shape,
        keys,
    )  # each crop dropped, as a worker copies it into its block and reuses the memory
    r["read"], datas = timed(lambda k: files[k].read_bytes(), keys)
    # as a worker decodes: each image dropped before the next (its memory reused); kept
    # for the steps below by a second, untimed pass
    r["decode"], _ = timed(lambda d: decode_capped(d, cap, None).shape, datas)
    rgbs = [decode_capped(d, cap, None) for d in datas]
    r["check"], entries = timed(lambda p: Entry.image(IDENT, "x", 0.0, p), rgbs)
    root = Path(tempfile.mkdtemp(dir=shm))
    try:
        ids = [f"{f}\0{0}" for f in files]
        writer = DiskStore(str(root), 1 << 40, mapped=True)
        r["write"] = written(writer, ids, entries)
        kept = [mapped.PROCESS.get(writer._root_id, i).pixels for i in ids]
        r["own_first_touch"], _ = timed(touch, kept)  # the kernel maps each page on first use
        r["own_touch_again"], _ = timed(touch, kept)
        floor = root / "floor"
        floor.mkdir()
        r["write_floor"] = written_floor(floor, entries)
        shutil.rmtree(floor)
        plans = [worker_plan(k)(rgb.shape[1], rgb.shape[0]) for k, rgb in enumerate(rgbs)]
        r["crop"], _ = timed(lambda k: crop_chw(rgbs[k], plans[k], ingest.IMAGE).shape, keys)
        # another worker of the node: a process whose table maps none of them yet
        mapped.PROCESS = mapped.Mappings()
        other = DiskStore(str(root), 1 << 40, mapped=True)
        r["first_read"], _ = timed(lambda i: other.get_many([i], [IDENT]), ids)
        r["hit"], hits = timed(lambda i: other.get_many([i], [IDENT]), ids)
        assert all(h[0] is not None for h in hits)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    root = Path(tempfile.mkdtemp(dir=disk))
    try:
        r["write_disk"] = written(DiskStore(str(root), 1 << 40), ids, entries)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return r


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--photo", help="WxH: photos of this size (cache.py's --photo corpus)")
    p.add_argument("--corpus-images", type=int, default=2048, help="the corpus to draw from")
    p.add_argument("--cap", type=int, default=320, help="cache_max_side (its default)")
    p.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    p.add_argument("--disk", type=Path, help="where write_disk writes (default: --out)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.disk = args.disk or args.out
    ingest.one_thread()
    if args.photo:
        corpus = cache_bench.sized_corpus(args.out, args.photo, args.corpus_images)
    else:
        corpus = ingest.make_corpus(args.out, args.corpus_images)
    files = sorted(corpus.rglob("*.jpg"))[: args.images]
    # the corpus's tasks as a rank of one has them in cache.py (its store holds the most)
    config = ingest.pool_config(corpus, 2).replace(files_per_task=MAX_FILES_PER_TASK)
    listing = list_shards(config)
    rank = RankPlan.of(listing, seed=ingest.SEED, shuffle=True, rank=0, world_size=1,
                       per_task=config.files_per_task)  # fmt: skip
    tasks = RankTasks.of(listing, rank, range(1))
    rounds = [one_round(files, args.shm, args.disk, args.cap, tasks) for _ in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    epoch0 = med["read"] + med["decode"] + med["check"] + med["write"] + med["crop"]
    disk0 = epoch0 - med["write"] + med["write_disk"]
    later_first, later = med["first_read"] + med["crop"], med["hit"] + med["crop"]
    free = med["read"] + med["decode"] + med["crop"]  # the cache's own steps free
    result = {"machine": platform.platform(), "args": {k: str(v) for k, v in vars(args).items()},
              "rounds": rounds, "median_ms": med, "cached_epoch0_ms": epoch0,
              "uncached_over_epoch0": med["uncached"] / epoch0,
              "disk_epoch0_ms": disk0, "uncached_over_disk_epoch0": med["uncached"] / disk0,
              "uncached_over_first_read": med["uncached"] / later_first,
              "uncached_over_hit": med["uncached"] / later,
              "floor_write": med["uncached"] / (free + med["write_floor"]),
              "floor_free": med["uncached"] / free}  # fmt: skip
    for k, v in med.items():
        print(f"{k:>11}: {v:.4f} ms/image")
    print(f"cached epoch 0: {epoch0:.3f} ms/image = {result['uncached_over_epoch0']:.2f}× the "
          f"uncached rate; a first read + crop {result['uncached_over_first_read']:.2f}×; "
          f"a hit + crop {result['uncached_over_hit']:.2f}×; with cache=\"disk\" under "
          f"{args.disk}, epoch 0 {disk0:.3f} ms/image = "
          f"{result['uncached_over_disk_epoch0']:.2f}×")  # fmt: skip
    print(f"bounds on a cached epoch 0 (read, whole decode, crop): with the kernel's write "
          f"{result['floor_write']:.2f}×, with every cache step free "
          f"{result['floor_free']:.2f}× the uncached rate")  # fmt: skip
    name = f"cache_parts-{args.photo or 'small'}-cap{args.cap}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
