"""Token throughput and padding: raypipe's plain padding, length buckets and packing,
against a DataLoader with a padding ``collate_fn`` (its ``num_workers`` swept), on the same
token Parquet.

    python benchmarks/tokens.py --docs 20000 --repeats 3 --json tokens.json

Each path delivers one rank's batches of an epoch (the consumer only touches them) after a
warm-up epoch; a figure is the median over ``--repeats`` runs of: real tokens per second,
and the padding share (positions in the batches that hold no token). The corpus: document
lengths log-normal (median about 150 tokens, clipped to 8..1024), int32 token ids.
The ``--repeats`` rounds run every path once each, in an order that rotates from round to
round, so no path always runs first (or right after the same other one).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

SEQ_LEN = 1024


def make_corpus(root: Path, docs: int, seed: int = 0) -> list[np.ndarray]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, 0.8, docs), 8, SEQ_LEN).astype(int)
    all_docs = [rng.integers(0, 50_000, n, dtype=np.int32) for n in lengths]
    root.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(np.array_split(np.arange(docs), 4)):
        column = pa.array([all_docs[i].tolist() for i in part], pa.list_(pa.int32()))
        pq.write_table(pa.table({"tokens": column}), root / f"part-{f}.parquet",
                       row_group_size=1024)  # fmt: skip
    return all_docs


def measure(batches, field: str = "tokens") -> tuple[int, int, float]:
    """(real tokens, padded positions, seconds) of one pass."""
    tokens = positions = 0
    t0 = time.perf_counter()
    for b in batches:
        if "segment_ids" in b:
            real = int((b["segment_ids"] > 0).sum())
        else:
            real = int(b[f"{field}_mask"].sum())
        tokens, positions = tokens + real, positions + b[field].numel()
    return tokens, positions, time.perf_counter() - t0


def raypipe_run(root: Path, batch_size: int, **kw) -> tuple[int, int, float]:
    import raypipe

    config = raypipe.PipelineConfig(source=str(root), image_column=None, batch_size=batch_size,
                                    actors=(2, 2), follow=False, **kw)  # fmt: skip
    out = None
    with raypipe.Pipeline(config, epochs=2, device="cpu", progress_s=0) as pipe:
        for epoch, batches in pipe.epochs():
            result = measure(batches)
            out = result if epoch == 1 else None
    return out


class TokenDataset:
    """A map-style dataset over the corpus, read once into memory (the DataLoader's best)."""

    def __init__(self, root: Path):
        import pyarrow.parquet as pq

        self.docs = []
        for path in sorted(root.glob("*.parquet")):
            column = pq.read_table(path).column("tokens").combine_chunks()
            flat, offsets = column.values.to_numpy(), column.offsets.to_numpy()
            self.docs.extend(flat[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True))

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.docs[i]


def pad_collate(docs: list[np.ndarray]) -> dict:
    import torch

    top = max(len(d) for d in docs)
    tokens = np.zeros((len(docs), top), dtype=np.int32)
    mask = np.zeros((len(docs), top), dtype=bool)
    for i, d in enumerate(docs):
        tokens[i, : len(d)], mask[i, : len(d)] = d, True
    return {"tokens": torch.from_numpy(tokens), "tokens_mask": torch.from_numpy(mask)}


def dataloader_run(root: Path, batch_size: int, workers: int) -> tuple[int, int, float]:
    import torch

    loader = torch.utils.data.DataLoader(
        TokenDataset(root), batch_size=batch_size, shuffle=True, collate_fn=pad_collate,
        num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None,
        drop_last=True,
    )  # fmt: skip
    measure(loader)  # warm-up epoch: workers started
    return measure(loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4],
                        help="DataLoader num_workers to sweep (default: %(default)s)")  # fmt: skip
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from raypipe import localnode

    root = Path(tempfile.mkdtemp(prefix="raypipe-tokens-"))
    make_corpus(root, args.docs)
    localnode.ensure()
    paths = {
        "raypipe padded": lambda: raypipe_run(root, args.batch_size),
        "raypipe bucketed": lambda: raypipe_run(root, args.batch_size, bucket_by="tokens"),
        "raypipe packed": lambda: raypipe_run(root, 8, pack="tokens", seq_len=SEQ_LEN),
        **{f"DataLoader padded, {w} workers": functools.partial(dataloader_run, root,
                                                                  args.batch_size, w)
           for w in args.workers},
    }  # fmt: skip
    runs = {name: [] for name in paths}
    names = list(paths)
    for r in range(args.repeats):  # rounds, each in an order rotated from the last
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(paths[name]())
    rows = {}
    for name in names:
        rate = [t / s for t, _, s in runs[name]]
        share = [1 - t / p for t, p, _ in runs[name]]
        rows[name] = {"tokens_per_s": statistics.median(rate), "range": [min(rate), max(rate)],
                      "padding_share": statistics.median(share), "rounds": rate}  # fmt: skip
        print(f"{name:32s} {rows[name]['tokens_per_s']:12,.0f} tokens/s "
              f"({min(rate):,.0f}-{max(rate):,.0f})  padding {rows[name]['padding_share']:.1%}",
              flush=True)  # fmt: skip
    sweep = {k: v for k, v in rows.items() if k.startswith("DataLoader")}
    best = max(sweep, key=lambda k: sweep[k]["tokens_per_s"])
    print(f"the DataLoader's best: {best}")
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(),
               "platform": platform.platform()}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": machine,
                                               "paths": rows, "dataloader_best": best},
                                              indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
