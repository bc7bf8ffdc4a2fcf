"""Document lengths for packing, read once when the shards are listed: one integer per key.

Packing (``PipelineConfig.pack``) fixes every rank's row count from the plan, before any
sample is read (`raypipe.loader.packing`), so it needs each document's token count: the
value lengths of a Parquet list column, read per file (the column's data is read, the
others are not). A column that is missing or is not a list of integers stops the run
here, before any Ray work, naming the file and the column's type.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raypipe.formats.parquet import ROWS_PER_READ
from raypipe.formats.storage import Storage

__all__ = ["sequence_lengths"]
assert __all__ == sorted(__all__)


def sequence_lengths(storage: Storage, shards: Sequence[tuple[str, int, int]], column: str, *,
                     field: str = "pack") -> np.ndarray:  # fmt: skip
    """The length of ``column``'s list in every row of ``shards`` (``(path, first_key,
    num_samples)``, dense keys): int64 per key. A file or row group that cannot be read gets
    zeros (its samples are skipped as unreadable when read); a null list is 0 long."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    total = sum(n for _, _, n in shards)
    out = np.zeros(total, dtype=np.int64)
    for path, first, n in shards:
        try:
            file = pq.ParquetFile(storage.open_arrow(path))
            schema = file.schema_arrow
        except Exception:  # pyarrow raises several types for a bad footer
            continue
        _check(schema, column, path, field)
        at = 0  # read as the reader reads (`parquet.read_groups`): from a page that cannot
        for g in range(file.num_row_groups):  # be read, the rest of its group is left at 0
            end = at + file.metadata.row_group(g).num_rows
            try:
                for batch in file.iter_batches(batch_size=ROWS_PER_READ, row_groups=[g],
                                               columns=[column]):  # fmt: skip
                    values = batch.column(column)
                    lengths = pc.fill_null(pc.list_value_length(values), 0)
                    lengths = lengths.to_numpy(zero_copy_only=False)[: max(0, n - at)]
                    out[first + at : first + at + len(lengths)] = lengths
                    at += batch.num_rows
            except Exception:  # a damaged page: pyarrow raises OSError, ArrowInvalid...
                pass  # its rows are the reader's unreadable skips
            at = end
    return out


def _check(schema, column: str, path: str, field: str) -> None:
    import pyarrow as pa

    if column not in schema.names:
        raise ValueError(f"PipelineConfig.{field}={column!r}: {path} has no such column "
                         f"(it has {schema.names})")  # fmt: skip
    t = schema.field(column).type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t))
            and pa.types.is_integer(t.value_type)):  # fmt: skip
        raise ValueError(f"PipelineConfig.{field}={column!r}: the column is {t} in {path}, "
                         "not a 1-D sequence of integers (list<int>)")  # fmt: skip
