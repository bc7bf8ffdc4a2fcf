"""`raypipe.loader.blocks` through a real local Ray: what an execution keeps referenced."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from raypipe import rayapi
from raypipe.loader.blocks import dataset_columns


def test_a_bundle_handed_on_is_not_kept_by_the_execution(ray_session):
    """Every bundle, the first too, is let go once the consumer has moved past it: a
    block kept referenced stays in the object store of the node that made it, and that
    node never idles (Ray 2.60's own ``Dataset._execute_to_iterator`` kept the first)."""
    import ray.data

    ds = ray.data.range(64, override_num_blocks=8).map_batches(lambda b: b, batch_size=None)
    bundles, executor = rayapi.execute_to_iterator(ds)
    try:
        gone = []
        for _ in range(3):
            bundle = next(bundles)
            gone.append(weakref.ref(bundle))
            del bundle
        gc.collect()
        assert [w() is None for w in gone[:2]] == [True, True]
    finally:
        executor.shutdown(force=True)


@pytest.mark.parametrize("materialized", [False, True])
def test_dataset_columns_reads_every_row_once(ray_session, materialized):
    import ray.data

    ds = ray.data.range(100, override_num_blocks=7)
    ds = ds.materialize() if materialized else ds
    ids = np.concatenate([c["id"] for c in dataset_columns(ds)])
    assert sorted(ids.tolist()) == list(range(100))


def test_blocks_whose_row_count_is_unknown_keep_their_slices(ray_session):
    """``BlockMetadata.num_rows`` is optional in Ray Data: a block that does not say how
    many rows it has is read, and each kept block keeps its own slice (the blocks were
    filtered by ``!= 0`` and their slices by truth, which paired them wrongly)."""
    from types import SimpleNamespace as Bundle

    import pyarrow as pa
    import ray

    from raypipe.loader.blocks import block_columns

    tables = [pa.table({"key": np.arange(a, a + 4)}) for a in (0, 10, 20)]
    blocks = [Bundle(ref=ray.put(t), metadata=Bundle(num_rows=n))
              for t, n in zip(tables, (None, 0, 4), strict=True)]  # fmt: skip
    slices = [None, None, Bundle(start_offset=1, end_offset=3)]
    got = [c["key"].tolist() for c in block_columns([Bundle(blocks=blocks, slices=slices)])]
    assert got == [[0, 1, 2, 3], [21, 22]]
