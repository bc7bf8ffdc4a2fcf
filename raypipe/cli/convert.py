"""Preprocess an image folder into WebDataset, Parquet or TFRecord shards with Ray tasks.

```
 driver: list the folder (sorted, dense keys) → spread them over S shards → index.json
   ▼ one Ray task per unfinished shard (read files → write temp → read back → rename)
 driver: as each task ends, record its counts in index.json and print progress
```

Shards are named ``{prefix}-00003-of-00016.tar`` (or ``.parquet``, ``.tfrecord``) and hold
the folder's samples in one seeded random order, every class in every shard (each sample
keeps its label, and its folder key as a field); ``index.json`` holds per-shard sample
counts and a fingerprint of the plan;
a rerun with the same plan skips the shards already finished.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from raypipe.cli.convertconfig import ShardsConfig
from raypipe.config import PipelineConfig
from raypipe.formats import Reader
from raypipe.formats.writer import EXTENSIONS, INDEX, Sample, Written, write_shard
from raypipe.plan.shards import list_shards

SPREAD_SEED = 0  # the one order a folder's samples are spread over its shards in
LEFTOVER_S = 600.0  # a shard's temporary file untouched this long is a killed write's


@dataclasses.dataclass(frozen=True)
class Summary:
    """The outcome of one convert run."""

    out: str
    shards: int
    written: int  # shards written by this run
    reused: int  # shards already finished by an earlier run
    samples: int
    skipped: tuple[tuple[str, str], ...]
    seconds: float
    samples_written: int = 0  # the samples of the shards this run wrote
    restarted: int = 0  # the JPEGs this run stored with restart markers
    markers: str = "off"  # restart markers, in words: how many, or why none

    @property
    def samples_per_s(self) -> float:
        """The rate of this run's writing (shards an earlier run finished not counted)."""
        return self.samples_written / self.seconds if self.seconds > 0 else 0.0


def shard_name(prefix: str, index: int, total: int, fmt: str) -> str:
    return f"{prefix}-{index:05d}-of-{total:05d}{EXTENSIONS[fmt]}"


def _stored_name(path: str, root: str) -> str:
    """``path`` relative to ``root``, as text every shard format stores: a file name that
    is not UTF-8 keeps its bytes escaped (``caf\\xe9.jpg``)."""
    return os.fsencode(os.path.relpath(path, root)).decode("utf-8", "backslashreplace")


def plan(config: ShardsConfig) -> tuple[list[list[Sample]], tuple[str, ...]]:
    """The folder's samples in one seeded random order, cut into shards; and the classes.
    (In key order, class by class, a shard read in order gave batches of one class.)"""
    root = os.path.abspath(config.source)
    if os.path.commonpath([root, os.path.abspath(config.out)]) == root:
        raise ValueError(f"convert.out={config.out!r} is inside convert.source: its folder "
                         "would read as one more class")  # fmt: skip
    listing = list_shards(PipelineConfig(source=config.source, format="imagefolder"))
    order = np.random.default_rng(SPREAD_SEED).permutation(len(listing.shards)).tolist()
    samples = [
        Sample(s.first_key, s.label, os.path.abspath(s.path), _stored_name(s.path, root))
        for s in (listing.shards[i] for i in order)
    ]
    n = len(samples)
    total = config.shards or -(-n // config.samples_per_shard)
    if total > n:
        raise ValueError(f"convert.shards={total} is more than the {n} samples in the folder")
    cuts = [i * n // total for i in range(total + 1)]
    return [samples[cuts[i] : cuts[i + 1]] for i in range(total)], listing.classes


def convert(config: ShardsConfig, *, log: TextIO | None = None) -> Summary:
    """Write the shards of ``config`` with Ray tasks on the connected (or a local) Ray.

    Progress goes to ``log`` (default: stderr), one line per finished shard.
    """
    import ray

    log = log or sys.stderr
    t0 = time.perf_counter()
    parts, classes = plan(config)
    out, total, fmt = os.path.abspath(config.out), len(parts), config.format
    os.makedirs(out, exist_ok=True)
    names = [shard_name(config.prefix, i, total, fmt) for i in range(total)]
    asked, rewrite = config.restart_markers, _restarts() if config.restart_markers else None
    config = dataclasses.replace(config, restart_markers=rewrite is not None)  # as written
    fingerprint, index = _earlier(config, parts)
    entries = (
        index["shards"] if index else [_planned(nm, p) for nm, p in zip(names, parts, strict=True)]
    )
    todo = [i for i, e in enumerate(entries) if not _finished(out, e, fmt)]
    _drop_leftovers(out, names, log)
    reused = total - len(todo)
    index = {
        "format": fmt,
        "prefix": config.prefix,
        "source": os.path.abspath(config.source),
        "classes": list(classes),
        "fingerprint": fingerprint,
        "num_shards": total,
        "num_samples": None,
        "restart_markers": config.restart_markers,
        "complete": False,
        "shards": entries,
    }
    _save_index(out, index)
    print(f"convert: {total} shards into {out} ({reused} already finished)", file=log)

    _check_cpus(config.cpus_per_task)
    task = ray.remote(num_cpus=config.cpus_per_task)(write_shard)
    pending = {task.remote(parts[i], out, names[i], fmt, rewrite): i for i in todo}
    reused_ids, written, restarted = set(range(total)) - set(todo), 0, 0
    skipped = [(p, why) for i in sorted(reused_ids) for p, why in entries[i]["skipped"]]
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        i = pending.pop(ready[0])
        w: Written = ray.get(ready[0])
        entries[i] = _entry(w, done=True)
        skipped.extend(w.skipped)
        written, restarted = written + w.samples, restarted + w.rewritten
        _save_index(out, index)
        done = total - len(pending)
        print(f"  [{done:>{len(str(total))}}/{total}] {w.name}: {w.samples} samples", file=log)
    index["num_samples"] = sum(e["samples"] for e in entries)
    firsts = np.cumsum([0] + [e["samples"] for e in entries])[:-1].tolist()
    for e, first in zip(entries, firsts, strict=True):
        e["first_key"] = first  # the key its first sample has when the shards are read
    index["complete"] = True
    _save_index(out, index)
    for path, reason in skipped:
        print(f"convert: skipped {path}: {reason}", file=log)
    return Summary(out, total, len(todo), reused, index["num_samples"], tuple(skipped),
                   time.perf_counter() - t0, written, restarted,
                   f"{restarted} JPEGs" if rewrite else
                   "off (region decoding was not built)" if asked else "off")  # fmt: skip


def check_out(config: ShardsConfig) -> None:
    """Fail, before any work, where ``config.out`` holds files no convert of this plan
    wrote (another dataset's, another convert's)."""
    rewrite = _restarts() if config.restart_markers else None
    _earlier(dataclasses.replace(config, restart_markers=rewrite is not None), plan(config)[0])


def _earlier(config: ShardsConfig, parts: list[list[Sample]]) -> tuple[str, dict | None]:
    """The plan's fingerprint, and the index of an earlier convert of it in ``out`` (None:
    none there); ValueError where ``out`` holds files and no index of a convert."""
    out, fingerprint = os.path.abspath(config.out), _fingerprint(config, parts)
    if not os.path.isdir(out):
        return fingerprint, None
    index = _load_index(out, fingerprint, _fingerprint(_other_markers(config), parts))
    if index is None and (present := _foreign(out)):
        raise ValueError(
            f"convert.out {out!r} holds files and no {INDEX} of a convert ({', '.join(present[:3])}"
            f"{', ...' if len(present) > 3 else ''}): use an empty or new folder"
        )
    return fingerprint, index


def _restarts():
    """What re-writes a JPEG with restart markers; None where region decoding was not built
    (no compiler or libjpeg headers), which decodes whole images whatever the file."""
    from raypipe.preprocess import region

    return region.with_restarts if region.available() else None


def _check_cpus(cpus: float) -> None:
    """A task no node of a local Ray started here can hold waits for ever: refused."""
    import ray

    from raypipe import localnode

    most = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
    if cpus > most and localnode.started_here():
        raise ValueError(f"convert.cpus_per_task={cpus:g} is more than this local Ray's "
                         f"{most:g} CPUs, and it gets no more nodes: lower it")  # fmt: skip


def _planned(name: str, part: list[Sample]) -> dict[str, Any]:
    return {"name": name, "samples": len(part), "first_key": part[0].key, "bytes": 0,
            "skipped": [], "done": False}  # fmt: skip


def _entry(w: Written, *, done: bool) -> dict[str, Any]:
    return {"name": w.name, "samples": w.samples, "first_key": w.first_key, "bytes": w.bytes,
            "skipped": [list(s) for s in w.skipped], "done": done}  # fmt: skip


def _finished(out: str, entry: dict[str, Any], fmt: str) -> bool:
    """A shard is finished when the index says so, the file has the size it was written
    with, and its headers count that many samples (it was read back whole when written:
    a rerun reads no image)."""
    path = os.path.join(out, entry["name"])
    if not entry["done"] or not os.path.isfile(path) or os.path.getsize(path) != entry["bytes"]:
        return False
    try:
        return Reader(fmt).count(path) == entry["samples"]
    except Exception:  # a damaged file is rewritten
        return False


def _fingerprint(config: ShardsConfig, parts: list[list[Sample]]) -> str:
    restarts = "|restart_markers" * config.restart_markers  # a plan's without: as before
    h = hashlib.sha256(f"{config.format}|{config.prefix}|{len(parts)}{restarts}".encode())
    for part in parts:
        h.update(b"|shard|")
        for s in part:
            size = os.path.getsize(s.path) if os.path.isfile(s.path) else -1
            h.update(f"{s.name}:{s.label}:{size};".encode())
    return h.hexdigest()


def _drop_leftovers(out: str, names: list[str], log: TextIO) -> None:
    """Remove the temporary files (``.NAME.PID.tmp``) of this plan's shards and index that
    killed writes left: a task out of memory or on a lost node, whose rerun writes under
    another process id. Only those untouched for `LEFTOVER_S`: a task writes its shard
    in one go once its samples are read, then reads it back, well within that."""
    ours, now, removed, size = {*names, INDEX}, time.time(), 0, 0
    for entry in os.scandir(out):
        stem, _, pid = entry.name[1:].removesuffix(".tmp").rpartition(".")
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp") and stem in ours
                and pid.isdigit()):  # fmt: skip
            continue
        try:
            st = entry.stat()
            if now - st.st_mtime > LEFTOVER_S:
                os.remove(entry.path)
                removed, size = removed + 1, size + st.st_size
        except FileNotFoundError:  # another convert's cleanup got there first
            continue
    if removed:
        print(f"convert: removed {removed} temporary files interrupted writes left "
              f"({size / 2**20:.1f} MiB)", file=log)  # fmt: skip


def _foreign(out: str) -> list[str]:
    """The files in ``out`` a convert would not have made (hidden ones and ``lost+found``,
    which file systems and desktops add, aside)."""
    return sorted(n for n in os.listdir(out) if not n.startswith(".") and n != "lost+found")


def _other_markers(config: ShardsConfig) -> ShardsConfig:
    return dataclasses.replace(config, restart_markers=not config.restart_markers)


def _load_index(out: str, fingerprint: str, other_markers: str) -> dict[str, Any] | None:
    """The index of an earlier convert of this plan in ``out``; None where there is none.
    ``other_markers``: the plan's fingerprint with the other ``restart_markers``."""
    path = os.path.join(out, INDEX)
    if not os.path.exists(path):
        return None
    try:
        index = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable index ({e}); remove it to start over") from None
    if index.get("fingerprint") == other_markers:
        was = bool(index.get("restart_markers"))  # an index from before the setting: False
        raise ValueError(
            f"{out} holds shards of this plan written with restart_markers: "
            f"{str(was).lower()}: set that to go on with them, or use a new output folder"
            + (" (region decoding was not built here, which writes them)"
               if was and _restarts() is None else "")
        )  # fmt: skip
    if index.get("fingerprint") != fingerprint:
        raise ValueError(
            f"{out} holds shards of another source or plan (index fingerprint differs); "
            "use a new output folder or remove the old one"
        )
    return index


def _save_index(out: str, index: dict[str, Any]) -> None:
    tmp = os.path.join(out, f".{INDEX}.{os.getpid()}.tmp")
    Path(tmp).write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, os.path.join(out, INDEX))


preprocess = convert  # its name in raypipe 0.1
