"""parallel.recompute=selective (parallel/recompute.py, parallel/output_recompute.py).

Same function: each part, and all the model's parts together, trains 5 AdamW steps (lr 1e-2,
so differences would grow) to the same losses and gradient norms as no recomputation, bit
for bit (tolerance 0: the recomputed values are the forward's own operations on the same
inputs), in fp32 and under bf16 autocast, on a GPT with gated experts, a shared expert and
dense blocks, and on one with latent attention (MLA).

Memory: the bytes held from forward to backward (the forward's tensors still alive at its
end, trainer/memory.py's live-tensor count: deterministic) drop by what the planner counts
for the part (parallel/planner/memory.py recompute_saved_elems x tokens x bytes): within 10%
for layernorm, moe_act, experts, shared_experts, mlp and mla_up_proj (measured exactly equal
but for experts, 0.984); layernorm under bf16 autocast exactly equal. core_attn: the planner counts the fused kernel's log-sum-exp (on a
GPU its output shares storage with the output projection's input); torch's CPU flash kernel
keeps its own [B, H, S, Dv] output besides, so here measured is exactly the count plus that
copy (the live-tensor count is deterministic): a count off by one lse fails. And the refusals, one line each.
"""
import dataclasses

import pytest
import torch

from models import build_model
from models.blocks import blocks
from moe.aux import collect_aux_loss
from parallel.plan import ParallelPlan
from parallel.precision import apply_precision
from parallel.planner.memory import recompute_saved_elems
from parallel.recompute import apply_recompute
from parallel.recompute_parts import RECOMPUTE_PARTS
from trainer.config import load_config
from trainer.memory import held_after
from trainer.planning import workload_from_config

B, S = 8, 16
GPT = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4",
       "model.d_ff=64", f"data.seq_len={S}", "model.activation=swiglu", "moe.num_experts=4",
       "moe.top_k=2", "moe.every=2", "moe.num_shared_experts=1", f"train.batch_size={B}"]
MLA = GPT + ["model.attention=mla", "model.kv_lora_rank=16", "model.q_lora_rank=24",
             "model.qk_rope_head_dim=4", "model.head_dim=8"]
GPT_PARTS = ("core_attn", "layernorm", "moe_act", "mlp", "shared_experts", "experts")


def _model(over, parts):
    cfg = load_config(None, over)
    model = build_model(cfg.model, cfg.moe, device="cpu", seed=0)
    if parts:
        apply_recompute(blocks(model), "selective", parts)
    return cfg, model


def _train(over, parts, bf16=False):
    _, model = _model(over, parts)
    if bf16:   # as train.py runs it: the blocks under autocast, the routers in fp32
        apply_precision(model, "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(5):
        t = torch.randint(0, 64, (B, S + 1), generator=torch.Generator().manual_seed(step))
        logits = model(t[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), t[:, 1:].flatten())
        (loss + collect_aux_loss(model)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), norm.item()))
    return out


@pytest.mark.parametrize("parts", [(p,) for p in GPT_PARTS] + [GPT_PARTS])
def test_each_part_equals_no_recomputation(parts):
    assert _train(GPT, parts) == _train(GPT, ())


def test_bf16_autocast_and_mla_equal_no_recomputation():
    assert _train(GPT, ("layernorm", "moe_act", "core_attn"), bf16=True) == _train(GPT, (), bf16=True)
    assert _train(MLA, ("mla_up_proj", "layernorm")) == _train(MLA, ())


def _held_bytes(over, parts, bf16=False) -> int:
    """Bytes of the tensors the forward made that are still alive at its end (what autograd
    keeps for the backward, and the logits): trainer/memory.py's live-tensor count (storages
    by data pointer, freed when their last tensor dies), exact where the profiler's per-op
    sums were not (their MLA figure swung from 0.76x to a negative)."""
    _, model = _model(over, parts)
    t = torch.randint(0, 64, (B, S))

    if bf16:   # as train.py runs it: the blocks under autocast, the routers in fp32
        apply_precision(model, "bf16")
    return held_after(lambda: model(t))


CPU_OUTPUT_COPY = 32 * 4 * 4 * B * S  # H x Dv = D fp32 per token, in each of the 4 blocks


@pytest.mark.parametrize("part", list(RECOMPUTE_PARTS))   # every part (parallel/recompute_parts.py)
def test_freed_memory_matches_the_planner(part):
    over = MLA if RECOMPUTE_PARTS[part].needs == "model.attention='mla'" else GPT
    low, high = 1 / 1.1, 1.1
    cfg = load_config(None, over + ["parallel.recompute=selective", f"parallel.recompute_modules={part}"])
    w = workload_from_config(cfg)
    plan = w.validate(cfg.parallel, 1)
    counted = sum(recompute_saved_elems(w, i, plan) for i in range(cfg.model.n_layers)) * B * S * 4
    measured = _held_bytes(over, ()) - _held_bytes(over, (part,))
    assert counted > 0 and measured > 0, (counted, measured)
    if part == "core_attn":  # exactly the count plus the CPU kernel's own output copy
        assert measured == counted + CPU_OUTPUT_COPY, (measured, counted, CPU_OUTPUT_COPY)
        return
    assert low <= measured / counted <= high, (part, measured, counted)


def test_layernorm_under_autocast_frees_the_projections_copy():
    """Under bf16 (train.py's: the blocks autocast, the routers in fp32) the attention's q/k/v
    keep one bf16 copy of the norm's output (moe/cast_once.py), announced as made from it:
    layernorm recomputes the copy too, D bf16 elements a token a block (before, only the
    router's fp32 input was freed). An MoE block's router keeps the FFN norm's fp32 output
    itself (2 D bf16 elements, freed); a dense FFN's readers cast it and keep their casts.
    Measured equal to the count (6 D bytes a token of an MoE block, 2 D of a dense one)."""
    cfg = load_config(None, GPT + ["parallel.precision=bf16", "parallel.recompute=selective",
                                   "parallel.recompute_modules=layernorm"])
    w = workload_from_config(cfg)
    plan = w.validate(cfg.parallel, 1)
    counted = sum(recompute_saved_elems(w, i, plan) for i in range(cfg.model.n_layers)) * B * S * 2
    measured = _held_bytes(GPT, (), bf16=True) - _held_bytes(GPT, ("layernorm",), bf16=True)
    moe_blocks = sum(w.is_moe_block(i) for i in range(cfg.model.n_layers))
    assert counted == (cfg.model.n_layers + 2 * moe_blocks) * cfg.model.d_model * B * S * 2
    assert measured == counted, (measured, counted)


def test_layernorm_beside_checkpointed_readers_frees_the_same():
    """A checkpointed mlp or shared_experts saves its input (the FFN norm's output) through
    the block's saved-tensor hooks too (torch's non-reentrant checkpoint), so layernorm frees
    it beside them as alone: measured 2 D fp32 a token a block with and without them, the
    planner's count (which once kept it as the checkpoint's input)."""
    parts = ("mlp", "shared_experts")
    cfg = load_config(None, GPT + ["parallel.recompute=selective",
                                   "parallel.recompute_modules=" + ",".join(parts + ("layernorm",))])
    w = workload_from_config(cfg)
    plan = w.validate(cfg.parallel, 1)
    base = dataclasses.replace(plan, recompute_modules=",".join(parts))
    counted = sum(recompute_saved_elems(w, i, plan) - recompute_saved_elems(w, i, base)
                  for i in range(cfg.model.n_layers)) * B * S * 4
    measured = _held_bytes(GPT, parts) - _held_bytes(GPT, parts + ("layernorm",))
    assert measured == counted == 2 * cfg.model.n_layers * cfg.model.d_model * B * S * 4, (measured, counted)


def test_layernorm_under_compile_keeps_the_block_and_norms_eager():
    """parallel.compile with layernorm: the block's saved-tensor hooks and the norms' notes
    cannot be traced (fullgraph raised "Attempted to inline function marked as skipped"), so
    parallel/compile.py compiles the block's other children, each whole, around them. One
    bf16 step equals the compiled run without recomputation bit for bit (aot_eager: the same
    graphs; inductor's fusions across the norms differ by 2.4e-7 relative, measured)."""
    from parallel.compile import compile_blocks, regions

    def grads(parts):
        _, model = _model(GPT, parts)
        done = compile_blocks(model, backend="aot_eager")
        t = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(t)
        (out.float().pow(2).mean() + collect_aux_loss(model)).backward()
        return done, [p.grad for p in model.parameters()]

    done, with_notes = grads(("layernorm",))
    block = next(iter(blocks(_model(GPT, ("layernorm",))[1])))
    compiled = regions(block)
    assert any(m is block.attn for m in compiled) and any(m is block.ffn for m in compiled)
    assert not any(m is block or m is block.attn_norm or m is block.ffn_norm for m in compiled)
    assert not any(hasattr(m, "attn_norm") for m in done)   # no block compiled whole
    _, plain = grads(())
    assert all(torch.equal(a, b) for a, b in zip(with_notes, plain))


def test_routed_row_activations_match_the_planner():
    """Each routed row a token adds (top_k 1 -> 2 -> 4) holds what the planner counts per row
    (parallel/planner/memory.py block_act_elems: the experts' input and the combine's output,
    D each, and the gated hidden 3 F): measured 1060 bytes a row in fp32, 1024 of them those
    tensors and 36 the row's indices and gate (a 3 D count, 1152, was 0.92 of it)."""
    from parallel.planner.memory import block_act_elems

    def counted(k):
        cfg = load_config(None, GPT + [f"moe.top_k={k}"])
        w = workload_from_config(cfg)
        plan = w.validate(cfg.parallel, 1)
        return sum(block_act_elems(w, i, "decoder", plan) for i in range(cfg.model.n_layers)) * B * S * 4

    held = {k: _held_bytes(GPT + [f"moe.top_k={k}"], ()) for k in (1, 2, 4)}
    for k1, k2 in ((1, 2), (2, 4)):
        measured, count = held[k2] - held[k1], counted(k2) - counted(k1)
        assert 1 <= measured / count <= 1.05, (k1, k2, measured, count)


@pytest.mark.parametrize("kw, world, match", [
    (dict(recompute="selective"), 1, r"parallel.recompute=selective needs parallel.recompute_modules"),
    (dict(recompute_modules="moe_act"), 1, r"is read by parallel.recompute=selective only"),
    (dict(recompute="selective", recompute_modules="attn"), 1,
     r"parallel.recompute_modules names 'attn'; use any of core_attn, layernorm"),
    (dict(recompute="selective", recompute_modules="layernorm", tp=4, tp_mode="2d"), 4,
     r"recompute_modules=layernorm with parallel.tp_mode=2d"),
    (dict(recompute="selective", recompute_modules="core_attn", cp=2), 2,
     r"recompute_modules=core_attn with parallel.cp=2"),
])
def test_refusals(kw, world, match):
    with pytest.raises(ValueError, match=match):
        ParallelPlan(**kw).validate(world)


def test_parts_the_model_lacks_are_refused_and_lists_are_accepted():
    cfg = load_config(None, GPT + ["parallel.recompute=selective", "parallel.recompute_modules=mla_up_proj"])
    w = workload_from_config(cfg)
    with pytest.raises(ValueError, match=r"recompute_modules=mla_up_proj: the model has no mla_up_proj "
                                         r"\(needs model.attention='mla'\)"):
        w.validate(cfg.parallel, 1)
    plan = ParallelPlan(recompute="selective", recompute_modules=["moe_act", " layernorm", "moe_act"]).validate(1)
    assert plan.recompute_parts == ("moe_act", "layernorm")
    cli = load_config(None, ["parallel.recompute=selective", "parallel.recompute_modules=core_attn,moe_act"])
    assert ParallelPlan(**vars(cli.parallel)).validate(1).recompute_parts == ("core_attn", "moe_act")
