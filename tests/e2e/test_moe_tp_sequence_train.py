"""train.py: MoE layers under 1-D tensor parallelism at micro-batch 1 (dropless token choice
routes tp's sequence split as it is, parallel/tensor/one_d.py; the sequence balance loss sums
each sequence's statistics over tp) train with the one-process losses (1e-4 relative:
reduction order only): tp2, and tp2 x dp2 x ep2 with the global-batch balance loss. A
capacity routes per sequence: whole sequences are swapped across tp (micro-batch 2)."""
import pytest

from tests.e2e.test_train import TINY, cache, four_steps_like_one_process  # noqa: F401 (cache: fixture)

pytestmark = pytest.mark.e2e
MBS1 = ["train.batch_size=4", "train.micro_batch_size=1"]


@pytest.mark.parametrize("extra, layout, nproc", [
    (MBS1, ["parallel.tp=2"], 2),
    (MBS1 + ["moe.balance_loss=global_batch"],
     ["parallel.tp=2", "parallel.dp=2", "parallel.ep=2"], 4),
    (["train.batch_size=4", "train.micro_batch_size=2", "moe.capacity_factor=1.25"],
     ["parallel.tp=2"], 2)])
def test_moe_under_tp_trains_like_one_process(tmp_path, cache, extra, layout, nproc):
    four_steps_like_one_process(tmp_path, TINY + extra + [f"data.cache_dir={cache}"], layout, nproc)
