"""Expert parallelism equals one process: outputs, gradients, AdamW losses, stats, errors.

Shapes: B sequences per rank, S tokens per sequence, D model dim, F ffn dim, E experts,
K top-k, P ranks. Every worker builds the one-process reference itself (same seed, full
weights) on the global batch and compares its own expert-parallel run against it; workers
return (case, metric, value, tolerance) rows and the parent asserts, so a failure names the
case. One spawn per world size runs all the checks for that size (process start is costly).

Tolerances (fp32): layer outputs and gradients 2e-6 absolute + 1e-5 relative (only the
order of a few float sums differs; the one bf16 case: 2e-3 + 1e-2 relative); losses and
grad norms of 5 AdamW steps 1e-5 relative (Adam divides by sqrt(v), which amplifies
last-bit differences of tiny gradients); final weights 1e-4 absolute.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoELayer
from moe.all_to_all import all_to_all
from parallel.apply import parallelize
from parallel.expert import apply_expert_parallel, is_expert_param
from parallel.mesh import build_meshes
from parallel.plan import ParallelPlan
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

D, F, S, B = 8, 12, 6, 2
TOL_ABS, TOL_REL = 2e-6, 1e-5
BF16_TOL = 1000  # bf16 layer checks: 2e-3 absolute + 1e-2 relative: one bf16 rounding of the
# result either way (tests/tolerance.py rule 3: 2u = 7.8e-3) plus the absolute term for cancellation
EXPERT_NAMES = ("w1", "w2", "w3", "b1", "b2", "b3")


def _device():
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _err(a, b) -> float:
    """Max |a-b| scaled so that <= 1 means within TOL_ABS + TOL_REL*|b|."""
    a, b = a.detach().float(), b.detach().float()
    return float(((a - b).abs() / (TOL_ABS + TOL_REL * b.abs())).max()) if a.numel() else 0.0


# ----------------------------------------------------------------------------- layer checks
def _layer_case(rank, P, meshes, E, k, cf, act, force, bias, rows, router="token_choice",
                dtype=torch.float32, experts_impl="auto"):
    name = f"P={P} E={E} k={k} cf={cf} {act} force={force} bias={bias} {router} {dtype}"
    name += "" if experts_impl == "auto" else f" experts_impl={experts_impl}"
    tol = 1 if dtype == torch.float32 else BF16_TOL
    dev = _device()
    torch.manual_seed(100 + E + k)
    ref = MoELayer(D, F, E, top_k=k, capacity_factor=cf, activation=act, expert_bias=bias,
                   router=router).to(device=dev, dtype=dtype)
    with torch.no_grad():
        for p in (ref.experts.b1, ref.experts.b2, ref.experts.b3):
            if p is not None:
                p.normal_()  # nonzero biases so their gradients are exercised too
        if force is not None:  # a large selection bias forces every token onto these experts
            ref.router.selection_bias[list(force)] = 10.0
    x_all = torch.randn(P * B, S, D, device=dev).to(dtype)
    g_all = torch.randn(P * B, S, D, device=dev).to(dtype)
    ep = copy.deepcopy(ref)
    ep.experts.experts_impl = experts_impl  # the reference keeps the default (loop) path
    par = parallelize(ep, meshes.plan, meshes)  # pure EP: dp = ep = P

    x_ref = x_all.clone().requires_grad_()
    y_ref = ref(x_ref)
    ((y_ref * g_all).sum() / P + ref.aux_loss).backward()

    sl = slice(rank * B, (rank + 1) * B)
    x = x_all[sl].clone().requires_grad_()
    with par.recording_comm():  # the forward's collectives, by kind (parallel/ledger.py)
        y = ep(x)
    fwd_bytes = par.ledger.take()
    ((y * g_all[sl]).sum() + ep.aux_loss).backward()  # gradients reduced at its end

    L = E // P
    rows.append((name, "output", _err(y, y_ref[sl]), tol))
    rows.append((name, "input grad", _err(x.grad / P, x_ref.grad[sl]), tol))
    aux = ep.aux_loss.detach().clone()
    dist.all_reduce(aux)
    rows.append((name, "aux loss", _err(aux / P, ref.aux_loss.detach()), tol))
    rows.append((name, "router grad", _err(ep.router.weight.grad, ref.router.weight.grad), tol))
    for n in EXPERT_NAMES:
        p, p_ref = getattr(ep.experts, n), getattr(ref.experts, n)
        if p is None:
            continue
        if p.grad is None:
            rows.append((name, f"{n}.grad exists", 1.0, 0))
            continue
        rows.append((name, f"{n} shape", float(p.shape[0] != L), 0))
        rows.append((name, f"{n} grad", _err(p.grad, p_ref.grad[rank * L:(rank + 1) * L]), tol))
    stats = par.sum_routing_stats({"layer": ep.last_stats})["layer"]
    rows.append((name, "global routed_E", float((stats.routed_E != ref.last_stats.routed_E).sum()), 0))
    rows.append((name, "global kept_E", float((stats.kept_E != ref.last_stats.kept_E).sum()), 0))
    rows.append((name, "global entropy", abs(float(stats.entropy - ref.last_stats.entropy)), 1e-6))
    # Bytes: each kept row goes out once in dispatch and once back in combine, no padding
    # (per rank the combine returns the rows it received, so compare group totals); the
    # dispatch first exchanges a [P, E] long count table.
    counts_table = P * E * 8
    payload = torch.tensor([fwd_bytes.get("expert_all_to_all", 0) - counts_table], device=dev)
    dist.all_reduce(payload)
    kept = int(stats.kept_E.sum())
    rows.append((name, "payload bytes - 2*kept rows", abs(int(payload) - 2 * kept * D * x.element_size()), 0))
    if cf is None and router == "token_choice":
        rows.append((name, "dropless kept == T*K", abs(kept - P * B * S * k), 0))
    if force is not None and len(force) >= k and len({f // L for f in force}) < P:
        # all k choices forced onto fewer than P ranks: some rank must really get no rows
        per_rank = stats.kept_E.view(P, L).sum(1)
        rows.append((name, "some rank receives no rows", float(bool((per_rank > 0).all())), 0))


# ----------------------------------------------------------------------------- training
class TinyMoENet(nn.Module):
    """in-proj -> residual MoE -> out-proj: dense and expert params, one MoE layer."""

    def __init__(self, E, k, cf):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.moe = MoELayer(D, F, E, top_k=k, capacity_factor=cf, activation="swiglu",
                            init_std=0.3)  # experts large enough to matter in the norm
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _batch(step, n_seq, dev):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n_seq, S, 5, generator=g).to(dev), torch.randn(n_seq, S, 3, generator=g).to(dev)


def _train(model, step_fn, steps=5):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        out.append(step_fn(model, step))
        opt.step()
    return out


def _train_case(rank, P, meshes, dp, ep, E, k, cf, rows):
    name = f"train P={P} dp={dp} ep={ep} E={E} k={k} cf={cf}"
    dev = _device()
    torch.manual_seed(7)
    ref = TinyMoENet(E, k, cf).to(dev)
    model = copy.deepcopy(ref)
    max_norm = 0.05  # small enough that every step clips: the norm must be right

    def ref_step(m, step):
        x, t = _batch(step, dp * B, dev)
        loss = nn.functional.mse_loss(m(x), t) + m.moe.aux_loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        return float(loss.detach()), float(norm)

    def ep_step(m, step):
        x, t = _batch(step, dp * B, dev)
        sl = slice(rank * B, (rank + 1) * B)
        loss = nn.functional.mse_loss(m(x[sl]), t[sl]) + m.moe.aux_loss
        loss.backward()
        norm = par.clip_grad_norm_(max_norm)
        return float(par.mean_over_dp(loss)), float(norm)

    par = parallelize(model, meshes.plan, meshes)
    ref_out, ep_out = _train(ref, ref_step), _train(model, ep_step)
    for step, ((l_ref, n_ref), (l_ep, n_ep)) in enumerate(zip(ref_out, ep_out)):
        rows.append((name, f"step {step} loss rel err", abs(l_ep - l_ref) / abs(l_ref), 1e-5))
        rows.append((name, f"step {step} grad norm rel err", abs(n_ep - n_ref) / n_ref, 1e-5))
        rows.append((name, f"step {step} clipped", float(n_ref <= max_norm), 0))
    L, r = E // ep, meshes.rank("ep")
    w_err = (model.moe.experts.w1 - ref.moe.experts.w1[r * L:(r + 1) * L]).detach().abs().max()
    rows.append((name, "final expert w1 max abs err", float(w_err), 1e-4))
    rows.append((name, "final router max abs err",
                 float((model.moe.router.weight - ref.moe.router.weight).detach().abs().max()), 1e-4))


# ----------------------------------------------------------------------------- bad input
def _expect_error(rows, name, fn, exc, words):
    try:
        fn()
    except exc as e:
        ok = all(w in str(e) for w in words)
        rows.append((f"error: {name}", f"message mentions {words}: {e}", float(not ok), 0))
        return
    rows.append((f"error: {name}", f"no {exc.__name__} raised", 1.0, 0))


def _error_cases(rank, P, rows):
    dev = _device()
    _expect_error(rows, "E % P", lambda: MoELayer(D, F, P + 1, 1, ep_group=dist.group.WORLD),
                  ValueError, ["num_experts", "divisible"])
    model = TinyMoENet(P + 1, 1, None).to(dev)
    full = model.moe.experts.w1.detach().clone()
    _expect_error(rows, "apply E % P", lambda: apply_expert_parallel(model, dist.group.WORLD),
                  ValueError, ["num_experts", "ep"])
    rows.append(("error: apply E % P", "weights untouched", float(not torch.equal(full, model.moe.experts.w1)), 0))
    _expect_error(rows, "ep does not divide dp*tp", lambda: ParallelPlan(dp=P, ep=P + 1).validate(P),
                  ValueError, ["parallel.ep=", "dp*tp"])
    only_rank0 = dist.new_group([0])
    if rank != 0:
        _expect_error(rows, "not a member", lambda: MoELayer(D, F, 2 * P, 1, ep_group=only_rank0),
                      ValueError, ["not a member"])
    layer = MoELayer(D, F, 2 * P, 1, ep_group=dist.group.WORLD)
    _expect_error(rows, "shard twice", lambda: layer.set_ep_group(dist.group.WORLD),
                  ValueError, ["already"])
    _expect_error(rows, "split mismatch", lambda: all_to_all(torch.zeros(3, D, device=dev), [1] * P, [1] * P),
                  ValueError, ["in_splits"])
    dist.barrier()  # every rank got here: no error path entered a collective alone


# ----------------------------------------------------------------------------- workers
def _worker(rank, P, layouts, layer_cases):
    torch.manual_seed(0)
    rows = []
    meshes = {}  # one set of groups per layout (creating groups is collective and costly)

    def meshes_for(dp, ep):
        if (dp, ep) not in meshes:
            meshes[dp, ep] = build_meshes(ParallelPlan(dp=dp, ep=ep).validate(P))
        return meshes[dp, ep]
    for E, k, cf, act, force, bias, *extra in layer_cases:
        _layer_case(rank, P, meshes_for(P, P), E, k, cf, act, force, bias, rows, *extra)
    for dp, ep, E, k, cf in layouts:
        _train_case(rank, P, meshes_for(dp, ep), dp, ep, E, k, cf, rows)
    _error_cases(rank, P, rows)
    # marks and names agree on every parameter of an expert-parallel model
    m = TinyMoENet(2 * P, 1, None)
    apply_expert_parallel(m, meshes_for(P, P).group("ep"))
    bad = [n for n, p in m.named_parameters() if is_expert_param(n) != is_expert_param(p)]
    rows.append(("is_expert_param", f"name/mark disagree on {bad}", float(len(bad)), 0))
    return rows


def _check(results):
    failures = [f"rank {r}: {case}: {metric} = {v:.3g} > {tol}"
                for r, rows in enumerate(results) for case, metric, v, tol in rows if v > tol]
    assert not failures, "\n".join(failures)
    assert sum(len(rows) for rows in results) > 0


# E, k, capacity factor, activation, forced experts, expert biases
LAYER_CASES_2 = [
    (4, 1, None, "gelu", None, False),
    (4, 2, None, "swiglu", None, True),
    (4, 1, 1.0, "gelu", None, False),
    (4, 2, 1.25, "relu", None, False),
    (4, 1, None, "swiglu", (0,), True),     # all tokens to expert 0: rank 1 receives nothing
    (4, 2, None, "gelu", (2, 3), False),    # all to rank 1's experts: rank 0 receives nothing
    (4, 2, 1.0, "gelu", (1, 2), False),     # forced over capacity: heavy drops on both ranks
    (4, 2, 1.0, "gelu", None, False, "expert_choice"),
    # grouped GEMMs on each rank against the one-process loop path; then rank 0 empty
    (4, 2, None, "swiglu", None, True, "token_choice", torch.float32, "grouped_mm"),
    (4, 2, 1.0, "gelu", (2, 3), True, "token_choice", torch.float32, "grouped_mm"),
]
LAYER_CASES_4 = [
    (8, 1, None, "gelu", None, False),
    (8, 2, None, "swiglu", None, True),
    (8, 1, 1.0, "gelu", None, False),
    (8, 2, 1.5, "gelu", None, False),
    (4, 2, None, "gelu", (0, 1), True),     # one expert per rank: ranks 2, 3 get nothing
    (8, 1, 1.0, "swiglu", (5,), False),     # one expert on rank 2, capacity drops
]


def test_expert_parallel_world2():
    # dp, ep, E, k, capacity factor
    layouts = [(2, 2, 4, 2, None), (2, 1, 4, 1, 1.0)]
    _check(run_distributed(_worker, 2, layouts, LAYER_CASES_2, timeout=180))


BF16_CASE = (4, 2, None, "swiglu", None, False, "token_choice", torch.bfloat16)


@pytest.mark.lowp
def test_expert_parallel_bf16_world2():
    _check(run_distributed(_worker, 2, [], [BF16_CASE], timeout=180))


def test_expert_parallel_world4():
    layouts = [(4, 2, 4, 2, None), (4, 4, 8, 1, 1.25), (4, 4, 4, 2, None)]
    _check(run_distributed(_worker, 4, layouts, LAYER_CASES_4, timeout=240))
