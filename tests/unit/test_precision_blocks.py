"""Every block of every stack runs in the low precision: gpt and switch (encoder and decoder
blocks) under parallel.precision=bf16 and fp16, with models.blocks() the one answer to
"which modules are the blocks" (precision once read model.blocks only, so a Switch model
trained every block in fp32 while the run said bf16).

Checked inside each block: the output dtype of every Linear (attention projections, the
dense FFN, MoE experts' grouped/looped matmuls show in their outputs' dtypes via the block's
own Linear layers). Tolerance: a 2-layer model's loss in bf16 (8 mantissa bits) stays within
2% relative of fp32 and in fp16 (11 bits) within 0.5%, over the same weights and batch.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import models
from models import ModelConfig, MoEConfig, build_model, init_weights
from parallel.apply import parallelize
from parallel.plan import ParallelPlan

LOW = {"bf16": (torch.bfloat16, 0.02), "fp16": (torch.float16, 0.005)}


def _model(arch: str):
    cfg = ModelConfig(arch=arch, vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                      max_seq_len=32, rel_pos_buckets=4, rel_pos_max_distance=8)
    return init_weights(build_model(cfg, MoEConfig(num_experts=4, top_k=2, every=1)), 0, "cpu")


def _loss(model, arch: str):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 17), generator=g)
    if arch == "switch":
        logits = model(ids[:, :12], ids[:, 12:-1])
        target = ids[:, 13:]
    else:
        logits = model(ids[:, :-1])
        target = ids[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def _dtypes_inside_blocks(model) -> dict:
    """{block index: set of Linear output dtypes seen inside it} during the next forward."""
    seen, hooks = {}, []
    for i, block in enumerate(models.blocks(model)):
        for m in block.modules():
            if isinstance(m, nn.Linear):
                hooks.append(m.register_forward_hook(
                    lambda _m, _a, out, i=i: seen.setdefault(i, set()).add(out.dtype)))
    return seen, hooks


def test_blocks_of_both_stacks():
    assert len(models.blocks(_model("gpt"))) == 2
    sw = _model("switch")
    assert models.blocks(sw) == list(sw.encoder.blocks) + list(sw.decoder.blocks)


@pytest.mark.lowp
@pytest.mark.parametrize("arch", ["gpt", "switch"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_block_runs_in_low_precision_and_tracks_fp32(arch, precision):
    dtype, rel = LOW[precision]
    ref = _loss(_model(arch), arch).item()
    model = _model(arch)
    parallelize(model, ParallelPlan(precision=precision).validate(1))
    seen, hooks = _dtypes_inside_blocks(model)
    got = _loss(model, arch).item()
    for h in hooks:
        h.remove()
    n_blocks = len(models.blocks(model))
    assert n_blocks == (4 if arch == "switch" else 2)
    assert sorted(seen) == list(range(n_blocks)), "a block ran no Linear"
    in_fp32 = [i for i, dtypes in seen.items() if dtypes != {dtype}]
    assert not in_fp32, f"{arch}/{precision}: blocks {in_fp32} ran matmuls in {[seen[i] for i in in_fp32]}"
    assert abs(got - ref) <= rel * abs(ref), f"{arch}/{precision}: loss {got} vs fp32 {ref}"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
