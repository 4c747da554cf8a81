"""Hot-expert replication computes the same function as plain expert parallelism.

Shapes: B sequences per rank, S tokens per sequence, D model dim, F ffn dim, E experts,
K top-k, P ranks, L = E/P owned experts per rank, R replica slots per rank.

Per world size (2 and 4), one spawn: with routing skewed by a router selection bias (a few
hot experts), a layer sharded with replica_slots R in {1, 2} is compared against the same
layer sharded with R = 0 on the same ranks and inputs: outputs, input gradient, router and
every expert gradient (owner slices), and 4 SGD steps of loss and weights of a tiny net;
dropless and with a capacity factor.
Also: rank_rows max/mean improves, rows are conserved, replicas really ran (replica
weights moved), state_dict keys and shapes are those of R = 0, and bad replica_slots values
give one clear error.

Tolerance (fp32): max |diff| <= 1e-6 * max |reference| (+ 1e-9) per tensor, for outputs,
every gradient, losses and weights (SGD: Adam would amplify last-bit differences). Replication
only splits an expert's weight-gradient sum over rows into partial sums on several ranks (then
adds them), so differences are a few ulps of the tensor's scale; elementwise relative error
is meaningless for gradient entries that are themselves sums cancelling to ~0.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from moe import MoELayer
from parallel.expert import apply_expert_parallel
from parallel.ledger import CommLedger
from tests.dist.harness import run_distributed
from tests.dist.same_function import check_rows, scaled_err, sgd_losses

pytestmark = pytest.mark.dist

D, F, S, B = 8, 12, 8, 2
HOT = {2: (0, 1), 4: (0, 1, 4)}   # experts given a large selection bias per world size


class TinyNet(nn.Module):
    def __init__(self, E, R, act, cf=None):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.moe = MoELayer(D, F, E, top_k=2, capacity_factor=cf, activation=act,
                            expert_bias=True, init_std=0.3, replica_slots=R)
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.moe(h))


def _skew(net, P, strength):
    with torch.no_grad():
        net.moe.router.selection_bias[list(HOT[P])] = strength
        for b in (net.moe.experts.b1, net.moe.experts.b2, net.moe.experts.b3):
            if b is not None:
                b.normal_()   # nonzero biases: their gradients are checked too


def _build(P, E, R, act, cf=None, seed=5):
    torch.manual_seed(seed)
    net = TinyNet(E, 0, act, cf)
    _skew(net, P, 1.5)   # hot but not exclusive: most tokens pick the hot experts
    rep = copy.deepcopy(net)
    rep.moe.replica_slots = R
    group = dist.group.WORLD
    apply_expert_parallel(net, group)
    apply_expert_parallel(rep, group)
    return net, rep


def _layer_rows(rank, P, E, R, act, cf, rows):
    name = f"P={P} E={E} R={R} {act} cf={cf}"
    base, rep = _build(P, E, R, act, cf)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(B, S, 5, generator=g)
    gy = torch.randn(B, S, 3, generator=g)
    out, moved = {}, {}
    ledger = CommLedger({"ep": dist.group.WORLD})
    for tag, net in (("base", base), ("rep", rep)):
        xi = x.clone().requires_grad_()
        with ledger.recording():
            y = net(xi)
            ((y * gy).sum() + net.moe.aux_loss).backward()
        moved[tag] = ledger.take().get("expert_all_to_all", 0)
        out[tag] = (y, xi.grad, net)
    (y0, gx0, n0), (y1, gx1, n1) = out["base"], out["rep"]
    rows.append((name, "output", scaled_err(y1, y0), 1))
    rows.append((name, "input grad", scaled_err(gx1, gx0), 1))
    for (pname, p0), (_, p1) in zip(n0.named_parameters(), n1.named_parameters()):
        rows.append((name, f"{pname} grad", scaled_err(p1.grad, p0.grad), 1))
    st0, st1 = n0.moe.last_stats, n1.moe.last_stats
    rows.append((name, "rank_rows conserved", float(int(st1.rank_rows.sum()) != int(st0.rank_rows.sum())), 0))
    rows.append((name, "unreplicated rows == R=0 rows",
                 float(not torch.equal(st1.rank_rows_unreplicated, st0.rank_rows)), 0))
    before, after = st0.rank_imbalance, st1.rank_imbalance
    rows.append((name, f"skewed without replicas (max/mean {before:.2f} >= 1.3)", float(before < 1.3), 0))
    rows.append((name, f"max/mean improves {before:.2f} -> {after:.2f} <= 1.15", float(after > 1.15), 0))
    # the same token rows move either way: the difference is the replica weights (forward)
    # and their gradients (backward), counted at the torch.distributed boundary
    moved_all = torch.tensor([moved["rep"] - moved["base"]])
    dist.all_reduce(moved_all)
    rows.append((name, "replica weights moved", float(int(moved_all) == 0), 0))
    sd0, sd1 = n0.state_dict(), n1.state_dict()
    same = list(sd0) == list(sd1) and all(sd0[k].shape == sd1[k].shape for k in sd0)
    rows.append((name, f"state_dict keys/shapes as R=0 {sorted(set(sd1) ^ set(sd0))}", float(not same), 0))


def _train_rows(rank, P, E, R, rows, steps=4):
    name = f"train P={P} E={E} R={R}"
    base, rep = _build(P, E, R, "swiglu", seed=9)
    losses = {tag: sgd_losses(net, rank, steps, B, S) for tag, net in (("base", base), ("rep", rep))}
    for step, (l0, l1) in enumerate(zip(losses["base"], losses["rep"])):
        rows.append((name, f"step {step} loss", scaled_err(l1, l0), 1))
    for (pname, p0), (_, p1) in zip(base.named_parameters(), rep.named_parameters()):
        rows.append((name, f"final {pname}", scaled_err(p1, p0), 1))


def _errors(rank, P, rows):
    def expect(case, fn, words):
        try:
            fn()
        except ValueError as e:
            rows.append((f"error: {case}", f"{e}", float(not all(w in str(e) for w in words)), 0))
            return
        rows.append((f"error: {case}", "no ValueError", 1.0, 0))
    expect("negative", lambda: MoELayer(D, F, 2 * P, 1, replica_slots=-1), ["replica_slots", ">= 0"])
    alone = [dist.new_group([p]) for p in range(P)][rank]   # every rank creates every group
    expect("one-rank group", lambda: MoELayer(D, F, 2 * P, 1, replica_slots=1, ep_group=alone),
           ["moe.replica_slots", "parallel.ep > 1"])
    expect("too many", lambda: MoELayer(D, F, 2 * P, 1, replica_slots=2 * P,
                                        ep_group=dist.group.WORLD), ["moe.replica_slots", "at most"])
    dist.barrier()


def _worker(rank, P, cases):
    rows = []
    for E, R, act, cf in cases:
        _layer_rows(rank, P, E, R, act, cf, rows)
    for E, R, _, _ in cases[:2]:
        _train_rows(rank, P, E, R, rows)
    _errors(rank, P, rows)
    return rows


def _check(results):
    check_rows(results, 20)


def test_replication_world2():
    # E, R, activation, capacity factor (2.0: hot experts drop rows before the exchange)
    cases = [(4, 1, "swiglu", None), (8, 2, "gelu", None), (8, 1, "relu", 2.0)]
    _check(run_distributed(_worker, 2, cases, timeout=120))


def test_replication_world4():
    _check(run_distributed(_worker, 4, [(8, 1, "swiglu", None), (8, 2, "gelu", None)], timeout=180))
