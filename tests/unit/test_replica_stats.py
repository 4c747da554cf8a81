"""rank_rows in one process, merging over micro-batches, and replica_slots argument checks."""
import pytest
import torch

from moe import MoELayer
from moe.stats import merge_stats


def test_one_process_rank_rows_hold_all_kept_rows():
    torch.manual_seed(0)
    layer = MoELayer(8, 16, 4, top_k=2, capacity_factor=1.0)
    layer(torch.randn(3, 6, 8))
    st = layer.last_stats
    kept = int(st.kept_E.sum())
    assert st.rank_rows.tolist() == [kept]
    assert st.rank_rows_unreplicated is None  # no replicas in one process: nothing to compare
    assert kept < 3 * 6 * 2          # capacity dropped some: rank_rows count kept rows only
    assert st.rank_imbalance == st.rank_imbalance_unreplicated == 1.0
    assert st.as_dict()["rank_rows"] == [kept]
    first = st
    layer(torch.randn(2, 6, 8))
    merged = merge_stats([first, layer.last_stats])
    assert merged.rank_rows.tolist() == [kept + int(layer.last_stats.kept_E.sum())]


def test_grouped_mm_path_keeps_rank_rows_on_device():
    layer = MoELayer(8, 16, 4, top_k=1, experts_impl="grouped_mm")
    layer(torch.randn(2, 5, 8))
    assert layer.last_stats.rank_rows.tolist() == [10]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_replica_slots(bad):
    with pytest.raises(ValueError, match="replica_slots=.*integer >= 0"):
        MoELayer(8, 16, 4, top_k=1, replica_slots=bad)


def test_replica_slots_shown():
    layer = MoELayer(8, 16, 4, top_k=1, replica_slots=2)
    assert "replica_slots=2" in repr(layer) and "replica_slots=2" in layer.routing_summary()
