"""train.py: DeepSeek's latent attention (MLA) under 1-D tensor parallelism (the heads split,
parallel/tensor/one_d.py) trains with the one-process losses (1e-4 relative: reduction
order only), tp2 and tp2 x ep2 (dp2)."""
import pytest

from tests.e2e.test_train import TINY, cache, four_steps_like_one_process  # noqa: F401 (cache: fixture)

pytestmark = pytest.mark.e2e
MLA = ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
       "model.qk_rope_head_dim=8", "model.head_dim=8", "model.n_heads=4"]


@pytest.mark.parametrize("layout, nproc", [(["parallel.tp=2"], 2),
                                           (["parallel.tp=2", "parallel.dp=2", "parallel.ep=2"], 4)])
def test_mla_under_tp_trains_like_one_process(tmp_path, cache, layout, nproc):
    four_steps_like_one_process(tmp_path, TINY + MLA + [f"data.cache_dir={cache}"], layout, nproc)
