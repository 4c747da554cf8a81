"""moe.dispatch_dtype under expert parallelism: each mode equals the one-process layer of the
same mode (the rounding to the wire format is part of the layer's function, moe/wire.py), and
the ledger's all-to-all bytes are the rows times the mode's row bytes per direction.

World 2, dp = ep = 2, E = 4, top-2, D = 160 (one full fp8 tile and a short one). Every
worker builds the one-process reference (same seed) on the global batch and compares its
own rows: output, input gradient, router gradient, its experts' gradients; then 5 AdamW
steps of a tiny MoE GPT under dp2 x ep2 against one process with the same mode.
Modes fp32, bf16 and fp8, the exchange whole and cut in 2 overlapped chunks
(moe.a2a_overlap_degree); auto and fp8 again under bf16 autocast (rows arrive in bf16). The same roundings at the same points leave fp32 summation order
as the only difference: 2e-6 absolute + 1e-5 relative on the layer (as tests/dist/
test_expert_parallel.py), 1e-5 relative on the losses and norms of 5 AdamW steps (Adam's
division by sqrt(v) amplifies last-bit differences of tiny gradients), except that the
5 steps run in fp64: in fp32 the two runs' weights drift apart by fp32 roundings (summation
order), and a value that then lies on the other side of a bf16 or fp8 rounding boundary
rounds to the other neighbour on the wire (tests/tolerance.py, rule 4: measured 2.5e-5 on the
step-4 norm, in bf16). In fp64 only the clipping norm is summed in fp32 (parallel/grads.py),
so the runs differ by the clip scale's fp32 rounding, which Adam amplifies as in any fp32
run: 1e-5 relative, as above (measured 1.2e-6), with the weights ~1e-10 apart, too close for
a wire rounding to flip but by rare chance. A bf16 or fp8
rounding that happened on one side only is 1e-3 or 6e-2 relative, far outside these bounds
(checked: the fp8 layer against the fp32 reference fails them).
Bytes per rank, forward + backward of one layer: A dispatched rows at the dispatch format,
N received rows back at the combine format, then N and A rows of gradients at the backward
format (moe/wire.py: fp32 4 D, bf16 2 D, fp8 D + 4 ceil(D/128) a row), plus the [P, E]
int64 count table; equal to the planner's a2a_row_bytes.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from moe import MoELayer
from parallel.apply import parallelize
from parallel.ledger import CommLedger
from parallel.mesh import build_meshes
from parallel.plan import ParallelPlan
from parallel.planner.comm import a2a_row_bytes
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed
from tests.tolerance import rounding_rtol

pytestmark = [pytest.mark.dist, pytest.mark.lowp]
D, F, E, K, B, S, P = 160, 32, 4, 2, 2, 6, 2
ATOL, RTOL = 2e-6, 1e-5
TRAIN_RTOL = 1e-5  # fp64 weights, fp32 clipping norm (see the docstring)
CASES = [(mode, d) for mode in ("fp32", "bf16", "fp8") for d in (1, 2)]
BF16_CASES = [("auto", 1), ("fp8", 2)]  # under bf16 autocast: the rows arrive in bf16


def _err(a, b) -> float:
    """Max |a-b| over (ATOL + RTOL |b|): <= 1 is within the bound."""
    a, b = a.detach().float(), b.detach().float()
    return float(((a - b).abs() / (ATOL + RTOL * b.abs())).max())


def _layer_case(rank, meshes, mode, degree, rows, bf16=False):
    """bf16: both sides under bf16 autocast (the same bf16 GEMMs on the same rows: one bf16
    rounding of a result apart at most, tests/tolerance.py rule 3, with 2e-3 absolute for
    cancellation, as tests/dist/test_expert_parallel.py's bf16 case)."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    tol = 1 if not bf16 else (2e-3 + rounding_rtol(torch.bfloat16)) / (ATOL + RTOL)
    torch.manual_seed(0)
    ref = MoELayer(D, F, E, K, dispatch_dtype=mode)
    x_all, g_all = torch.randn(P * B, S, D), torch.randn(P * B, S, D)
    ep = copy.deepcopy(ref)
    ep.a2a_overlap_degree = degree
    par = parallelize(ep, meshes.plan, meshes)
    x_ref = x_all.clone().requires_grad_()
    with autocast:
        ((ref(x_ref).float() * g_all).sum() / P).backward()
        y_ref = ref(x_all).detach()

    sl = slice(rank * B, (rank + 1) * B)
    x = x_all[sl].clone().requires_grad_()
    ledger = CommLedger({"ep": meshes.group("ep")})
    with ledger.recording(), autocast:
        y = ep(x)
        (y.float() * g_all[sl]).sum().backward()
    name = f"{mode} overlap {degree}" + (" bf16 autocast" if bf16 else "")
    rows.append((name, "output", _err(y, y_ref[sl]), tol))
    rows.append((name, "input grad", _err(x.grad / P, x_ref.grad[sl]), tol))
    rows.append((name, "router grad", _err(ep.router.weight.grad, ref.router.weight.grad), tol))
    L = E // P
    for n in ("w1", "w2"):
        got, want = getattr(ep.experts, n).grad, getattr(ref.experts, n).grad[rank * L:(rank + 1) * L]
        rows.append((name, f"{n} grad", _err(got, want), tol))
    # dropless: this rank sends B S K rows; it receives its experts' rows of the global batch
    sent = B * S * K
    got_rows = int(ref.last_stats.kept_E[rank * L:(rank + 1) * L].sum())
    disp_b, comb_b, bwd_b = a2a_row_bytes(mode, "bf16" if bf16 else "fp32", D)
    want = sent * disp_b + got_rows * comb_b + (got_rows + sent) * bwd_b + P * E * 8
    rows.append((name, "a2a bytes - rows x row bytes", abs(ledger.take().get("expert_all_to_all", 0) - want), 0))


def _train_case(world, mode, degree, rows):
    model_cfg, moe_cfg = dc.configs()
    moe_cfg.dispatch_dtype, moe_cfg.a2a_overlap_degree = mode, degree
    ref_cfg = copy.deepcopy(moe_cfg)
    ref_cfg.a2a_overlap_degree = 1
    ref = dc.reference_run(model_cfg, ref_cfg, dtype=torch.float64)
    got = dc.train_layout(world, {"dp": 2, "ep": 2}, model_cfg, moe_cfg, dtype=torch.float64)
    for step, ((l, g), (rl, rg)) in enumerate(zip(got, ref)):
        rows.append((f"{mode} overlap {degree} train", f"step {step} loss", abs(l - rl) / abs(rl) / TRAIN_RTOL, 1))
        rows.append((f"{mode} overlap {degree} train", f"step {step} norm", abs(g - rg) / abs(rg) / TRAIN_RTOL, 1))


def _worker(rank, world):
    torch.manual_seed(0)
    meshes = build_meshes(ParallelPlan(dp=P, ep=P).validate(world))
    rows = []
    for mode, degree in CASES:
        _layer_case(rank, meshes, mode, degree, rows)
    for mode, degree in BF16_CASES:
        _layer_case(rank, meshes, mode, degree, rows, bf16=True)
    for mode, degree in [("bf16", 1), ("fp8", 2)]:
        _train_case(world, mode, degree, rows)
    # the bound has power: the fp8 layer against the fp32 reference fails it
    torch.manual_seed(0)
    ref, x = MoELayer(D, F, E, K), torch.randn(P * B, S, D)
    fp8 = copy.deepcopy(ref)
    fp8.dispatch_dtype = "fp8"
    rows.append(("fp8 vs fp32 (must differ)", "within bound", float(_err(fp8(x), ref(x)) <= 1), 0))
    return rows


def test_dispatch_dtypes_under_expert_parallelism_equal_one_process():
    results = run_distributed(_worker, P, timeout=300)
    failures = [f"rank {r}: {case}: {metric} = {v:.3g} > {tol}"
                for r, rows in enumerate(results) for case, metric, v, tol in rows if v > tol]
    assert not failures, "\n".join(failures)
    assert sum(len(rows) for rows in results) >= 2 * ((len(CASES) + len(BF16_CASES)) * 6 + 20)
