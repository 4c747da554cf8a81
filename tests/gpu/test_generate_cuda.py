"""Generation on one GPU: the KV-cached forward gives the whole-sequence logits on CUDA (fp32,
TF32 off: 1e-4), greedy cache == no-cache tokens, CUDA-generator sampling repeats by seed; and
`python -m trainer.generate` / `trainer.evaluate` on a run trained on the GPU (run.device=cuda)."""
import os
import subprocess
import sys
from pathlib import Path

import torch

import models
from models.config import ModelConfig, MoEConfig
from models.generation import Sampling, generate

ROOT = Path(__file__).resolve().parents[2]


def test_kv_cache_and_sampling_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    m = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                    max_seq_len=64)
    moe_cfg = MoEConfig(num_experts=4, top_k=2, every=1, capacity_factor=None)
    model = models.init_weights(models.build_model(m, moe_cfg), seed=1, device="cuda").eval()
    ids = torch.randint(1, 97, (2, 20), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        cache = model.new_cache()
        cached = torch.cat([model(ids[:, :7], cache=cache)] +
                           [model(ids[:, i:i + 1], cache=cache) for i in range(7, 20)], dim=1)
        torch.testing.assert_close(cached, model(ids), rtol=1e-4, atol=1e-4)
    g = Sampling(temperature=0)
    assert torch.equal(generate(model, ids[:, :5], 24, g), generate(model, ids[:, :5], 24, g, use_cache=False))
    s = Sampling(temperature=1.0, top_p=0.9)
    draw = lambda seed: generate(model, ids[:, :5], 24, s, torch.Generator("cuda").manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))


def test_generate_and_evaluate_commands_on_cuda(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = tmp_path / "run"

    def call(*args):
        out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout
    # eager: what is tested here is generation (compiling the blocks, parallel.compile=auto's
    # default on CUDA, cost this test the GPU tier's time limit on an H200)
    call("train.py", "run.device=cuda", "train.steps=10", "train.eval_every=10", f"run.dir={run}",
         "parallel.compile=false")
    out = call("-m", "trainer.generate", str(run), "--prompt", "def ", "--max-new-tokens", "32",
               "--temperature", "0")
    assert "one process on cuda" in out and "KV cache" in out
    assert out.split("--- sample")[1:] == call("-m", "trainer.generate", str(run), "--prompt", "def ",
                                               "--max-new-tokens", "32", "--temperature", "0",
                                               "--no-cache").split("--- sample")[1:]
    assert "perplexity" in call("-m", "trainer.evaluate", str(run))
