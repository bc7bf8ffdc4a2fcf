"""Step 2 of the rank iterator: re-batch to exactly ``batch_size`` rows.

Ranks with the same number of rows do not get the same blocks (a rank's blocks follow its
tasks and its bad samples), and Ray's own batcher can cut short batches mid-stream (Ray
issue 66085). Cutting batches here makes every rank's batch count ``rows // batch_size``
(with ``drop_last``), so DDP ranks run the same number of steps.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

import numpy as np

from raypipe.loader.collate import holding_dtype


def rebatch(
    batches: Iterable[dict[str, np.ndarray]], batch_size: int, *, drop_last: bool
) -> Iterator[dict[str, np.ndarray]]:
    """Step 2: batches of exactly ``batch_size`` rows; a short last one only if not drop_last.

    A batch that already has the right size passes through without a copy.
    """
    pending: list[dict[str, np.ndarray]] = []
    have = 0
    for batch in batches:
        rows = _rows(batch)
        if rows == 0:
            continue
        if have == 0 and rows == batch_size:
            yield batch
            continue
        pending.append(batch)
        have += rows
        while have >= batch_size:
            out, pending = _split(pending, batch_size)
            have -= batch_size
            yield out
    if have and not drop_last:
        yield _concat(pending)


def _rows(batch: dict[str, np.ndarray]) -> int:
    return len(next(iter(batch.values())))


def _split(pieces: list[dict[str, np.ndarray]], n: int):
    """First ``n`` rows of ``pieces`` as one batch, and the rest."""
    head, rest, need = [], [], n
    for piece in pieces:
        rows = _rows(piece)
        if need == 0:
            rest.append(piece)
        elif rows <= need:
            head.append(piece)
            need -= rows
        else:
            head.append({k: v[:need] for k, v in piece.items()})
            rest.append({k: v[need:] for k, v in piece.items()})
            need = 0
    return _concat(head), rest


def _concat(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(pieces) == 1:
        return pieces[0]
    return {k: concat_column([p[k] for p in pieces], k) for k in pieces[0]}


def concat_column(parts: list[np.ndarray], field: str = "") -> np.ndarray:
    """Rows of ``parts`` in one array; a ragged (object, one array per row) part makes the
    result ragged too (a user transform's field that differed in shape in some block), as
    do stacked parts whose rows differ in shape (each worker stacks a field whose rows all
    had one shape there: another worker's may have had another). Signed and unsigned
    integers join as int64 (`holding_dtype`; numpy's common type is float64)."""
    ragged = [p.dtype == object for p in parts]
    if all(ragged):
        return np.concatenate(parts)
    if not any(ragged) and len({p.shape[1:] for p in parts}) == 1:
        return np.concatenate(parts, dtype=holding_dtype(field, parts), casting="unsafe")
    rows = [row for p in parts for row in (p if p.dtype == object else list(p))]
    out = np.empty(len(rows), dtype=object)
    out[:] = rows
    return out


def held_ahead(
    blocks: Iterator[dict[str, np.ndarray]], rows: int
) -> Iterator[dict[str, np.ndarray]]:
    """``blocks`` in order, each once ``rows`` more rows were pulled after it (or the blocks
    ended): what a rank tells its gate runs ``rows`` ahead of the batches it forms."""
    held: collections.deque[dict[str, np.ndarray]] = collections.deque()
    count = 0
    for block in blocks:
        held.append(block)
        count += len(block["key"])
        while held and count - len(held[0]["key"]) >= rows:
            count -= len(held[0]["key"])
            yield held.popleft()
    yield from held
