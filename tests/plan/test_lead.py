"""The default lead: enough batches for rare ledger reports, within the rank's store share."""

import pytest

from raypipe import PipelineConfig
from raypipe.plan.blocksize import LEAD_MAX, LEAD_SHARE, lead_for

BATCH = 256 * 3 * 224 * 224  # bytes of a batch of 256 224x224 images


def test_the_default_lead_is_the_most_within_its_share_of_the_store():
    assert PipelineConfig(source="x").lead_batches is None  # sized, not 0
    assert lead_for(BATCH, 64 * 2**30 / 8) == LEAD_MAX  # a GPU node's store: the most
    assert lead_for(BATCH, None) == LEAD_MAX  # no store known yet
    small = 2**30 / 8  # a 1 GiB store shared by 8 ranks
    assert lead_for(BATCH, small) == int(LEAD_SHARE * small // BATCH) < LEAD_MAX
    assert lead_for(BATCH, BATCH) == 0  # a share of one batch: no lead
    assert lead_for(BATCH, 1e15) == LEAD_MAX


@pytest.mark.parametrize("bad", [-1, 1.5, "4"])
def test_a_bad_lead_is_refused(bad):
    with pytest.raises(ValueError, match="lead_batches"):
        PipelineConfig(source="x", lead_batches=bad)
