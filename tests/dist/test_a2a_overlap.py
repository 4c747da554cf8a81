"""moe.a2a_overlap_degree: the chunked, overlapped expert-parallel exchange computes the same
function as the plain one, and really overlaps.

Shapes: B sequences per rank, S tokens per sequence, D model dim, F ffn dim, E experts, P ranks.

Per world size (2 and 4), one spawn: a tiny net around an MoE layer sharded over all ranks
with a2a_overlap_degree d in {2, 4} against the same net with d = 1 on the same ranks and
inputs: outputs, input gradient, every parameter gradient, and 4 SGD steps of loss and
weights; dropless, with a capacity factor, with hot-expert replicas, with shared experts.
The timeline (moe/profiling/timeline.py) of a d = 2 forward+backward shows chunk 1's dispatch
in flight while chunk 0's experts compute, the combine of chunk 0 in flight while chunk 1
computes, and the shared experts running while dispatch 0 flies.

Tolerance (fp32): max |diff| <= 1e-6 * max |reference| (+ 1e-9) per tensor. Chunking only
regroups each expert's rows, so an expert's weight gradient is a sum over the same rows in
a different grouping: differences are a few ulps of the tensor's scale.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoELayer
from moe.profiling.timeline import Timeline
from parallel.expert import apply_expert_parallel
from tests.dist.harness import run_distributed
from tests.dist.same_function import check_rows, scaled_err, sgd_losses

pytestmark = pytest.mark.dist

D, F, S, B = 8, 12, 8, 3


class TinyNet(nn.Module):
    def __init__(self, E, cf, R, shared):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.moe = MoELayer(D, F, E, top_k=2, capacity_factor=cf, activation="swiglu",
                            expert_bias=True, init_std=0.3, replica_slots=R,
                            num_shared_experts=shared)
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _pair(E, cf, R, shared, d, seed=3):
    torch.manual_seed(seed)
    base = TinyNet(E, cf, R, shared)
    if R:
        with torch.no_grad():
            base.moe.router.selection_bias[:2] = 1.5   # hot experts: replicas get used
    over = copy.deepcopy(base)
    over.moe.a2a_overlap_degree = d
    apply_expert_parallel(base, dist.group.WORLD)
    apply_expert_parallel(over, dist.group.WORLD)
    return base, over


def _compare(rank, case, rows, steps=4):
    E, cf, R, shared, d = case
    name = f"E={E} cf={cf} R={R} shared={shared} d={d}"
    base, over = _pair(*case)
    g = torch.Generator().manual_seed(10 + rank)
    x, gy = torch.randn(B, S, 5, generator=g), torch.randn(B, S, 3, generator=g)
    grads = {}
    for tag, net in (("base", base), ("over", over)):
        xi = x.clone().requires_grad_()
        y = net(xi)
        ((y * gy).sum() + net.moe.aux_loss).backward()
        grads[tag] = (y, xi.grad, [p.grad for p in net.parameters()])
    (y0, gx0, g0), (y1, gx1, g1) = grads["base"], grads["over"]
    rows += [(name, "output", scaled_err(y1, y0), 1), (name, "input grad", scaled_err(gx1, gx0), 1)]
    rows += [(name, f"{n} grad", scaled_err(a, b), 1)
             for (n, _), a, b in zip(base.named_parameters(), g1, g0)]
    rows.append((name, "rank rows equal", float(not torch.equal(over.moe.last_stats.rank_rows,
                                                                 base.moe.last_stats.rank_rows)), 0))
    losses = {tag: sgd_losses(net, rank, steps, B, S) for tag, net in (("base", base), ("over", over))}
    rows += [(name, f"step {i} loss", scaled_err(a, b), 1) for i, (a, b) in enumerate(zip(losses["over"], losses["base"]))]
    rows += [(name, f"final {n}", scaled_err(a, b), 1)
             for (n, a), (_, b) in zip(over.named_parameters(), base.named_parameters())]


def _timeline_rows(rank, P, rows):
    _, over = _pair(2 * P, None, 0, 1, 2)
    tl = Timeline()
    over.moe.set_timeline(tl)
    x = torch.randn(B, S, 5, generator=torch.Generator().manual_seed(rank))
    over(x).sum().backward()
    name = f"timeline P={P} d=2"
    for exchange, compute in (("dispatch 1", "experts 0"), ("combine 0", "experts 1"),
                              ("dispatch 0", "shared experts")):
        rows.append((name, f"{exchange} in flight during {compute}",
                     float(not tl.in_flight_during(exchange, compute)), 0))
    issued = {n for k, n, _, _ in tl.events if k == "issue"}
    want = {f"{p} {c}{b}" for p in ("dispatch", "combine") for c in (0, 1) for b in ("", " bwd")}
    rows.append((name, f"every exchange issued fwd and bwd (missing {want - issued})",
                 float(not want <= issued), 0))
    waited = {n for k, n, _, _ in tl.events if k == "wait"}
    rows.append((name, "every issue waited once", float(waited != issued), 0))


def _errors(rank, P, rows):
    for bad in (0, -1, 1.5, True):
        try:
            MoELayer(D, F, 2 * P, 1, a2a_overlap_degree=bad)
            rows.append(("error", f"{bad!r} accepted", 1.0, 0))
        except ValueError as e:
            rows.append(("error", str(e), float("a2a_overlap_degree" not in str(e)), 0))
    alone = [dist.new_group([p]) for p in range(P)][rank]
    try:
        MoELayer(D, F, 2 * P, 1, a2a_overlap_degree=2, ep_group=alone)
        rows.append(("error", "one-rank ep group accepted", 1.0, 0))
    except ValueError as e:
        rows.append(("error", str(e), float("parallel.ep > 1" not in str(e)), 0))
    dist.barrier()


def _worker(rank, P, cases):
    rows = []
    for case in cases:
        _compare(rank, case, rows)
    _timeline_rows(rank, P, rows)
    _errors(rank, P, rows)
    return rows


def _check(results):
    check_rows(results, 40)


def test_a2a_overlap_world2():
    # E, capacity factor, replica slots, shared experts, degree
    cases = [(4, None, 0, 0, 2), (4, None, 0, 1, 4), (8, 1.0, 0, 0, 2), (4, None, 1, 0, 2)]
    _check(run_distributed(_worker, 2, cases, timeout=120))


def test_a2a_overlap_world4():
    cases = [(8, None, 0, 1, 2), (8, 1.25, 0, 0, 4), (8, None, 2, 0, 4)]
    _check(run_distributed(_worker, 4, cases, timeout=180))
