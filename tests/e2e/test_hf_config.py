"""train.py end to end with hf.config: a small model of DeepSeek-V3's architecture (its
published config.json, sizes overridden on the command line: MLA, a dense first block,
shared + routed experts with sigmoid group-limited routing and bias balancing).

- The start-up line names the architecture and the file; the resolved config.toml in the run
  dir keeps the values (mla) and the file.
- cp=2 (ring) with ep=2 on 2 processes trains with the one-process losses (1e-4 relative:
  reduction order only), and its checkpoint resumes in one process.
"""
import pytest

from tests.e2e.test_train import cache, close, losses, resume_after_step3, train  # noqa: F401 (cache: fixture)
from trainer.config import load_config

pytestmark = pytest.mark.e2e

SMALL = ["--config", "configs/models/deepseek_v3.toml", "model.d_model=32", "model.n_layers=2",
         "model.n_heads=4", "model.head_dim=8", "model.q_lora_rank=16", "model.kv_lora_rank=16",
         "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.d_ff=64", "moe.num_experts=8",
         "moe.first_moe_layer=1", "moe.d_ff=16", "moe.n_group=4", "moe.topk_group=2",
         "moe.top_k=2", "model.vocab_size=256", "model.max_seq_len=64",
         "parallel.precision=fp32", "train.batch_size=8", "data.seq_len=32",
         "data.max_bytes=1000000", "train.eval_every=0", "train.steps=6", "checkpoint.every=3",
         "train.warmup_steps=2"]


@pytest.mark.long
def test_deepseek_architecture_trains_under_cp_and_ep_like_one_process(tmp_path, cache):
    common = SMALL + [f"data.cache_dir={cache}"]
    one, par = tmp_path / "one", tmp_path / "par"
    out = train(common + [f"run.dir={one}"], tmp_path)
    line = next(s for s in out.stdout.splitlines() if s.startswith("model:"))
    assert "deepseek_v3 architecture" in line and "deepseek_v3.json" in line, line
    saved = load_config(one / "config.toml")
    assert saved.model.attention == "mla" and saved.hf.config.endswith("deepseek_v3.json")
    train(common + ["parallel.cp=2", "parallel.ep=2", f"run.dir={par}"], tmp_path, nproc=2)
    ref, got = losses(one), losses(par)
    assert sorted(got) == list(range(1, 7))
    for step in ref:
        assert close(got[step], ref[step], 1e-4), (step, got[step], ref[step])
    resume_after_step3(par, common, tmp_path, ref, 1e-4)
