"""Host syncs of an expert-parallel MoE layer (moe/profiling/census.py, gloo): the flat
dispatch makes the host wait once per layer forward (the [P, E] count table) and never in
backward (it reuses the forward's splits); the hierarchical dispatch at most twice per forward
(the count table; the unique rows per node with the rows this rank receives as a proxy).
Cases: dropless, capacity 1.0 and one hot-expert replica slot per rank (world 2, flat), and
hierarchical dispatch on 2 nodes of 2 ranks (world 4), dropless and with capacity."""
import pytest
import torch

from moe import MoELayer
from moe.nodes import expert_nodes
from moe.profiling.census import OpCensus
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
D, F, E, K, S = 32, 64, 8, 2, 16


def _syncs(rank, world, gpn, cases):
    out = {}
    for name, kw in cases:
        torch.manual_seed(0)
        layer = MoELayer(D, F, E, K, kw.get("cf"), "swiglu", replica_slots=kw.get("R", 0),
                         dispatch=kw.get("dispatch", "flat"))
        layer.set_ep_group(torch.distributed.group.WORLD)
        if gpn:
            layer.set_expert_nodes(expert_nodes(range(world), gpn))
        torch.manual_seed(1 + rank)
        x = torch.randn(4, S, D, requires_grad=True)
        layer(x).sum().backward()   # warm
        with OpCensus() as fwd:
            y = layer(x)
        with OpCensus() as bwd:
            y.backward(torch.ones_like(y))
        out[name] = (fwd.sync_ops, bwd.sync_ops)
    return out


def _check(world, gpn, cases, most):
    for outs in run_distributed(_syncs, world, gpn, cases, timeout=120):
        for name, (fwd, bwd) in outs.items():
            assert len(fwd) <= most, (name, fwd)
            assert fwd, (name, "the count table must be read once")  # the census sees it
            assert bwd == [], (name, bwd)


def test_flat_dispatch_waits_once_per_forward_world2():
    _check(2, 0, [("dropless", {}), ("capacity", {"cf": 1.0}), ("replicas", {"R": 1})], 1)


def test_hierarchical_dispatch_waits_at_most_twice_world4():
    _check(4, 2, [("dropless", {"dispatch": "hierarchical"}),
                  ("capacity", {"dispatch": "hierarchical", "cf": 1.0})], 2)
