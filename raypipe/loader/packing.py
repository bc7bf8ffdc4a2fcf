"""Step 3 for language models: documents packed into rows of exactly ``seq_len`` tokens.

```
 the rank's documents, in plan order ─► rows of seq_len tokens, a document that does not
   fit continuing in the next row ─► batches of batch_size rows:
     <pack>        (B, seq_len)  the tokens (the column's dtype), 0 where padding
     segment_ids   (B, seq_len)  int64: 0 padding, 1, 2, ... the document pieces of a row
     position_ids  (B, seq_len)  int64: 0, 1, ... from the start of each piece
     key           list          the keys of the documents that end in this batch
```

Equal batch counts without waiting on other ranks: every document's length is read when
the shards are listed (`raypipe.formats.lengths`), so every rank knows, before the epoch
starts, how many rows each rank's documents fill: ``rows_r = ceil(tokens_r / seq_len)``
for rank r's keys of the plan (`raypipe.plan.rankplan.RankPlan.split`). Every rank then
yields the same ``n`` batches:

- ``drop_last=False``: ``n = max_r ceil(rows_r / B)``; a rank with fewer rows ends with
  padding rows (segment 0): every token of every document once per epoch over the ranks.
- ``drop_last=True``: ``n = min_r full_r // B`` (``full_r = tokens_r // seq_len``, no
  padding at all); a rank's tokens after its ``n·B``-th row are its tail, dropped and
  counted (``stats()["dropped_tokens"]``).

A skipped (bad) document leaves its rows to padding: the count stays the plan's. The
packing is a function of the plan and the skips, so the same seed packs the same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from raypipe.loader.collate import holding_dtype

__all__ = ["MAX_DOCUMENTS_PER_BLOCK", "Packing", "documents", "documents_per_block", "pack"]
assert __all__ == sorted(__all__)

Columns = dict[str, np.ndarray]
MAX_DOCUMENTS_PER_BLOCK = 4096


def documents_per_block(config, listing):
    """``config`` with ``rows_per_block`` (documents per actor block), when unset, as many
    documents as fill one batch of packed rows on average: ``batch_size`` counts rows of
    ``seq_len`` tokens, not documents, and blocks of ``batch_size`` short documents would
    cost a block each for a fraction of a batch."""
    if config.pack is None or config.rows_per_block is not None or listing.lengths is None:
        return config
    mean = max(1.0, float(np.mean(listing.lengths))) if len(listing.lengths) else 1.0
    docs = int(np.ceil(config.batch_size * config.seq_len / mean))
    return config.replace(rows_per_block=min(MAX_DOCUMENTS_PER_BLOCK, max(config.batch_size, docs)))


@dataclasses.dataclass(frozen=True, eq=False)
class Packing:
    """The packing of one run: ``field`` packed into rows of ``seq_len`` tokens, ``lengths``
    the listed length of every key's document."""

    field: str
    seq_len: int
    batch_size: int
    drop_last: bool
    lengths: np.ndarray
    gated = False  # the plan fixes the batch counts: no ledger round trips

    def rows(self, plan, epoch: int) -> list[int]:
        """Rows each rank's documents of ``epoch`` fill: the last one partly, or, with
        ``drop_last``, full rows only."""
        L, drop = self.seq_len, self.drop_last
        tokens = [int(self.lengths[keys].sum()) for keys in plan.split(epoch)]
        return [t // L if drop else -(-t // L) for t in tokens]

    def batches(self, plan, epoch: int) -> int:
        """The batches every rank yields in ``epoch``."""
        B, rows = self.batch_size, self.rows(plan, epoch)
        return min(r // B for r in rows) if self.drop_last else max(-(-r // B) for r in rows)

    def __call__(self, blocks: Iterable[Columns], epoch: int, plan, counts: dict):
        """The rank's batches of ``epoch`` from its blocks of documents."""
        rows = self.batches(plan, epoch) * self.batch_size
        docs = documents(blocks, self.field, self.lengths)
        return pack(docs, self.field, seq_len=self.seq_len, batch_size=self.batch_size,
                    rows=rows, counts=counts)  # fmt: skip


def documents(blocks: Iterable[Columns], field: str, lengths: np.ndarray | None = None):
    """``(key, tokens)`` of every row of ``blocks``; a value that is not a 1-D integer
    sequence (an empty one of any type: a transform's ``[]`` is float64), or not as long as
    listed (a transform changed it), raises ValueError."""
    for block in blocks:
        for key, value in zip(block["key"], block[field], strict=True):
            doc, key = np.asarray(value), int(key)
            if doc.ndim != 1 or (doc.dtype.kind not in "iu" and doc.size):
                raise ValueError(f"pack={field!r}: key {key} holds {doc.dtype} with "
                                 f"{doc.ndim} dims, not a 1-D sequence of integers")  # fmt: skip
            if lengths is not None and len(doc) != lengths[key]:
                raise ValueError(f"pack={field!r}: key {key} has {len(doc)} tokens, but "
                                 f"{lengths[key]} when listed; a transform must keep the "
                                 "packed field's length")  # fmt: skip
            yield key, doc


class _Rows:
    """The batch being filled: a cursor (row, col) into preallocated (B, L) arrays, and the
    last full batch, held until a token goes to the next one (an empty document read
    after the last row still ends in it)."""

    def __init__(self, field: str, seq_len: int, batch_size: int):
        self.field, self.L, self.B = field, seq_len, batch_size
        self.row = self.col = self.segment = self.made = 0
        self.dtype = np.dtype(np.int64)  # until a document says otherwise
        self.tokens = self.segments = self.positions = None
        self.keys: list[int] = []
        self.done: Columns | None = None

    def put(self, piece: np.ndarray) -> None:
        """One document piece, at most the rest of the row, as the row's next segment."""
        if self.tokens is None:
            self.dtype = piece.dtype if len(piece) else self.dtype
            self._alloc()
        elif len(piece) and not np.can_cast(piece.dtype, self.dtype):  # files of two types
            self._widen(piece)
        r, c, n = self.row, self.col, len(piece)
        self.segment += 1
        self.tokens[r, c : c + n] = piece
        self.segments[r, c : c + n] = self.segment
        self.positions[r, c : c + n] = np.arange(n)
        self.col += n

    def ended(self, key: int) -> None:
        """Document ``key`` ends here (in the held batch, when every row is made)."""
        if self.tokens is None and self.done is not None:
            self.done["key"] = np.append(self.done["key"], np.array([key], dtype=object))
        else:
            self.keys.append(key)

    def end_row(self) -> None:
        """Close the row (what is left of it padding); a full batch is held in ``done``."""
        if self.tokens is None:
            self._alloc()
        self.row, self.col, self.segment, self.made = self.row + 1, 0, 0, self.made + 1
        if self.row == self.B:
            assert self.done is None, "a full batch was not taken"
            self.done = self._take()

    def ready(self) -> Iterator[Columns]:
        """The held full batch, if there is one."""
        if self.done is not None:
            batch, self.done = self.done, None
            yield batch

    def _widen(self, piece: np.ndarray) -> None:
        """The batch's tokens in the type that holds ``piece``'s too (as `pad_collate`
        pads rows of two types): a cast into the first document's type would wrap ids."""
        self.dtype = holding_dtype(self.field, [self.tokens, piece])
        self.tokens = self.tokens.astype(self.dtype)

    def _alloc(self) -> None:
        shape = (self.B, self.L)  # (rows of the batch, tokens per row)
        self.tokens = np.zeros(shape, dtype=self.dtype)
        self.segments = np.zeros(shape, dtype=np.int64)
        self.positions = np.zeros(shape, dtype=np.int64)

    def _take(self) -> Columns:
        keys = np.empty(len(self.keys), dtype=object)  # a list on the host: no device copy
        keys[:] = self.keys
        batch = {self.field: self.tokens, "segment_ids": self.segments,
                 "position_ids": self.positions, "key": keys}  # fmt: skip
        self.tokens = self.segments = self.positions = None
        self.row, self.keys = 0, []
        return batch


def pack(docs: Iterable[tuple[int, np.ndarray]], field: str, *, seq_len: int, batch_size: int,
         rows: int, counts: dict) -> Iterator[Columns]:  # fmt: skip
    """Exactly ``rows`` packed rows (a multiple of ``batch_size``) of ``docs`` in order, as
    batches: the documents' tokens, then padding rows; tokens beyond ``rows`` rows are
    dropped. ``counts`` gets ``tokens``, ``dropped_tokens``, ``padding_tokens``,
    ``packed_rows``."""
    assert rows % batch_size == 0, (rows, batch_size)
    out = _Rows(field, seq_len, batch_size)
    tokens = dropped = 0
    for key, doc in docs:
        n, at = len(doc), 0
        if n == 0 and (out.made < rows or out.done is not None):
            out.ended(key)
        while at < n and out.made < rows:
            yield from out.ready()
            take = min(seq_len - out.col, n - at)
            out.put(doc[at : at + take])
            at, tokens = at + take, tokens + take
            if at == n:
                out.ended(key)  # before its row can end the batch
            if out.col == seq_len:
                out.end_row()
        dropped += n - at
    while out.made < rows:  # the last partial row, then padding rows
        yield from out.ready()
        out.end_row()
    yield from out.ready()
    counts.update(tokens=tokens, dropped_tokens=dropped, padding_tokens=rows * seq_len - tokens,
                  packed_rows=rows)  # fmt: skip
