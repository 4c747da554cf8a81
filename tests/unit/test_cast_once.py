"""models/cast_once.py: under bf16 autocast the attention's projections share one bf16 copy of
their fp32 input (MHA/GQA: q, k, v; MLA: its two down-projections) instead of a cast each.

Memory: a forward holds exactly (readers - 1) x D bf16 elements per token and block less
(trainer/memory.py's live-tensor count, 4 blocks minus 2; the planner always counted one copy).
Function: the forward is bit-equal to a cast per reader (the same cast); every gradient equal
within fp32 summation order (the readers' bf16 gradients are summed in fp32 either way;
normwise 1e-6 relative); fp32 runs are untouched (the same tensor object reaches every reader).
"""
import pytest
import torch

import models.layers as layers
from models import build_model
from trainer.config import load_config
from trainer.memory import held_after

B, S = 2, 32
GPT = ["model.vocab_size=64", "model.d_model=64", "model.n_heads=4", "model.d_ff=128",
       f"data.seq_len={S}", "moe.every=0", f"train.batch_size={B}"]
MLA = GPT + ["model.attention=mla", "model.kv_lora_rank=16", "model.q_lora_rank=24",
             "model.qk_rope_head_dim=4", "model.head_dim=8"]
CASES = {"mha": (GPT, 3), "mla": (MLA, 2)}


def _model(over, n_layers):
    cfg = load_config(None, over + [f"model.n_layers={n_layers}"])
    return build_model(cfg.model, cfg.moe, device="cpu", seed=0)


def _held(over, n_layers) -> int:
    model = _model(over, n_layers)
    t = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(t)
    return held_after(forward)


def _per_block(over) -> float:
    return (_held(over, 4) - _held(over, 2)) / 2


@pytest.mark.parametrize("case", list(CASES))
def test_one_copy_for_the_readers(case, monkeypatch):
    over, n = CASES[case]
    shared = _per_block(over)
    monkeypatch.setattr(layers, "readers", lambda x, k: (x,) * k)   # a cast per reader
    apart = _per_block(over)
    assert apart - shared == (n - 1) * 64 * B * S * 2, (apart, shared)


def _run(over, bf16):
    model = _model(over, 2)
    t = torch.randint(0, 64, (B, S + 1), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(t[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), t[:, 1:].flatten())
    loss.backward()
    return logits.detach(), [p.grad for p in model.parameters()]


@pytest.mark.lowp
@pytest.mark.parametrize("case", list(CASES))
def test_same_function_as_a_cast_per_reader(case, monkeypatch):
    over, _ = CASES[case]
    logits, grads = _run(over, True)
    fp32 = _run(over, False)
    monkeypatch.setattr(layers, "readers", lambda x, k: (x,) * k)
    ref_logits, ref_grads = _run(over, True)
    assert torch.equal(logits, ref_logits)
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() <= 1e-6 * r.abs().max().clamp_min(1e-30)
    ref32 = _run(over, False)
    assert torch.equal(fp32[0], ref32[0]) and all(torch.equal(a, b) for a, b in zip(fp32[1], ref32[1]))


FP8 = GPT + ["model.d_model=128", "model.d_ff=256"]   # FP8 tiles: dims of 16 and 128


def _fp8_run(n_layers: int, monkeypatch, shared: bool):
    """(bytes a forward holds, logits, gradients) of the FP8 model under bf16 autocast with
    torchao's Float8Linears behaving as on a GPU: torch.is_autocast_enabled() -- CUDA's, the
    query they read -- answering for the CPU's autocast, its dtype bf16. shared=False: the
    projections take x as they did on a GPU before (each casting and keeping its own copy)."""
    from parallel.fp8 import apply_fp8
    real = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *dev: real(*(dev or ("cpu",))))
    monkeypatch.setattr(torch, "get_autocast_gpu_dtype", lambda: torch.bfloat16)
    if not shared:
        monkeypatch.setattr(layers, "_share_cast", lambda *mods: all(type(m) is layers.Linear for m in mods))
    model = _model(FP8, n_layers)
    apply_fp8(model, "tensorwise")
    t = torch.randint(0, 64, (B, S + 1), generator=torch.Generator().manual_seed(1))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(t[:, :-1])
    held = held_after(forward)
    logits = forward()
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), t[:, 1:].flatten()).backward()
    monkeypatch.undo()
    return held, logits.detach(), [p.grad for p in model.parameters()]


def test_fp8_projections_keep_one_copy_as_on_a_gpu(monkeypatch):
    """On a GPU torchao's Float8Linear casts its input to CUDA's autocast dtype itself and
    keeps that cast for backward, so q, k and v kept three bf16 copies of the norm's output
    where the planner counts one. Handed readers()' one copy (models/layers._share_cast) their
    cast is a no-op and they keep it: 2 D bf16 elements a token and block less, measured, the
    logits bit for bit the same and the gradients within fp32 summation order (1e-6)."""
    per_block = {}
    for shared in (True, False):
        (h4, logits, grads), (h2, _, _) = (_fp8_run(n, monkeypatch, shared) for n in (4, 2))
        per_block[shared] = ((h4 - h2) / 2, logits, grads)
    assert per_block[False][0] - per_block[True][0] == 2 * 128 * B * S * 2, per_block
    assert torch.equal(per_block[True][1], per_block[False][1])
    for g, r in zip(per_block[True][2], per_block[False][2]):
        assert (g - r).abs().max() <= 1e-6 * r.abs().max().clamp_min(1e-30)
