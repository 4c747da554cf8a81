"""moe.gates_in_experts (moe/row_gates.py): each routed row's gate applied inside its expert.

Same function: every expert path with the gates inside gives what the path gives without them,
weighted afterwards, y = g * FFN(x) (+ nothing more), and the same gradients for x, g and every
weight: the loop and the plain-ops path in fp64 (1e-12 relative, normwise), grouped_mm in fp32
(2e-6), with biases (b2 weighted too) and with moe_act's recomputation. The FP8 emulations
quantize w2's input with the gate in it: a row's 1 x 128 tile scale follows the gate, so the
rounding moves; bound 2 u_e4m3 = 0.125 relative, normwise (measured at most 0.046, on w1's
gradient under rowwise).
The layer: one process with the gates inside equals the weighted combine in fp64 (1e-12) for
dropless, capacity-dropping, expert-choice and shared-expert layers. Memory: a forward holds
r K (D + F - 1) fp32 elements per token and MoE block less, exactly: the combine's saved
expert outputs go, so does the activation output (the fused op computes it again in backward),
and each row's fp32 gate stays with its expert (parallel/planner/memory.py block_act_terms;
measured equal).
Distributed layouts: tests/dist/test_gates_in_experts.py; the exchanges' calls and bytes:
tests/unit/test_dispatch_calls.py.
"""
import copy

import pytest
import torch

from moe import MoELayer
from moe.experts import ExpertBank

N_PER, D, F, E = (5, 0, 7, 3), 16, 24, 4


def _bank(act, bias, dtype, impl):
    torch.manual_seed(0)
    bank = ExpertBank(E, D, F, act, bias=bias, experts_impl=impl).to(dtype)
    with torch.no_grad():
        for p in (bank.b1, bank.b2, bank.b3):
            if p is not None:
                p.normal_()
    return bank


def _grads(bank, x, g, counts, gated, run):
    x, g = x.clone().requires_grad_(), g.clone().requires_grad_()
    y = run(bank, x, counts, g) if gated else run(bank, x, counts, None) * g.to(x.dtype).unsqueeze(1)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
    out = [y.detach(), x.grad, g.grad] + [p.grad for p in bank.parameters()]
    bank.zero_grad(set_to_none=True)
    return out


def _normwise(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _forward(bank, x, counts, g):
    return bank(x, counts, gate_N=g)


def _ops(bank, x, counts, g):
    return bank._forward_ops(x, list(counts), gate_N=g)


PATHS = [("loop", torch.float64, _forward, 1e-12), ("ops", torch.float64, _ops, 1e-12),
         ("grouped_mm", torch.float32, _forward, 2e-6)]


@pytest.mark.parametrize("impl, dtype, run, bound", PATHS, ids=[p[0] for p in PATHS])
@pytest.mark.parametrize("act, bias, recompute", [("swiglu", False, False), ("gelu", True, False),
                                                  ("swiglu", True, True)])
def test_each_expert_path_with_the_gates_inside_equals_weighing_after(impl, dtype, run, bound, act,
                                                                      bias, recompute):
    bank = _bank(act, bias, dtype, "grouped_mm" if impl == "grouped_mm" else "loop")
    bank.set_recompute_act(recompute)
    x = torch.randn(sum(N_PER), D, dtype=dtype)
    g = torch.rand(sum(N_PER), dtype=torch.float32 if dtype == torch.float32 else dtype) + 0.1
    want = _grads(bank, x, g, N_PER, False, run)
    got = _grads(bank, x, g, N_PER, True, run)
    assert len(got) == len(want) and all(w is not None for w in want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert _normwise(a, b) <= bound, (i, _normwise(a, b))


@pytest.mark.lowp
@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_fp8_emulations_with_the_gates_inside_round_within_e4m3(recipe):
    D8, F8 = 128, 256
    torch.manual_seed(0)
    bank = ExpertBank(2, D8, F8, "swiglu")
    bank.set_fp8(True, recipe)
    x = torch.randn(12, D8, dtype=torch.bfloat16)
    g = torch.rand(12) + 0.1
    counts = (7, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _grads(bank, x, g, counts, False, _forward)
        got = _grads(bank, x, g, counts, True, _forward)
    errs = [_normwise(a, b) for a, b in zip(got, want)]
    assert max(errs) <= 2 * 2.0 ** -4, errs


LAYERS = [dict(), dict(capacity_factor=0.5), dict(router="expert_choice"),
          dict(num_shared_experts=1, expert_bias=True)]


@pytest.mark.parametrize("kw", LAYERS, ids=["dropless", "capacity", "expert_choice", "shared_bias"])
def test_layer_with_the_gates_inside_equals_the_weighted_combine(kw):
    torch.manual_seed(0)
    weighted = MoELayer(D, F, E, top_k=2, activation="swiglu", **kw).double()
    gated = copy.deepcopy(weighted)
    gated.gates_in_experts = True
    x = torch.randn(3, 8, D, dtype=torch.float64)
    outs = []
    for layer in (weighted, gated):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, D, dtype=y.dtype) + layer.aux_loss).sum().backward()
        outs.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(outs[1], outs[0]):
        assert _normwise(a, b) <= 1e-12


def test_gates_in_experts_is_refused_unless_a_bool():
    with pytest.raises(ValueError, match=r"gates_in_experts='yes' \(moe.gates_in_experts\) must be true or false"):
        MoELayer(D, F, E, gates_in_experts="yes")


def test_a_forward_holds_the_combines_saved_outputs_less():
    """Held bytes at the forward's end (trainer/memory.py's live-tensor count, as tests/unit/
    test_selective_recompute.py measures a part), fp32: the drop is what the planner's
    block_act_terms stop counting when the gates are inside."""
    from parallel.planner.memory import block_act_terms
    from tests.unit.test_selective_recompute import GPT, _held_bytes, B, S
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    over = GPT + ["moe.num_shared_experts=0"]
    cfg = load_config(None, over)
    w = workload_from_config(cfg)
    plan = w.validate(cfg.parallel, 1)
    gated = workload_from_config(load_config(None, over + ["moe.gates_in_experts=true"]))
    counted = sum(sum(block_act_terms(w, i, "decoder", plan).values())
                  - sum(block_act_terms(gated, i, "decoder", plan).values())
                  for i in range(cfg.model.n_layers)) * B * S * 4
    measured = _held_bytes(over, ()) - _held_bytes(over + ["moe.gates_in_experts=true"], ())
    assert counted > 0 and measured == counted, (measured, counted)
