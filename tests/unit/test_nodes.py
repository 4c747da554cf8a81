"""Nodes of the expert-parallel group, without process groups: moe/nodes.py (labels, proxies,
errors), parallel/plan.py's ep groups and node checks against mesh.rank_groups, moe/
hierarchical.py's proxy_table, MoEConfig's dispatch / max_nodes, the planner's nodes per token
(against brute-force enumeration) and intra/inter-node all-to-all bytes, MoELayer's options.

Shapes: P ranks of the ep group, W expert slots per rank, E experts, K top-k, n nodes, M
max_nodes, A assignments a rank sends, N rows its experts receive, U unique (token, node) rows.
"""
import dataclasses
from itertools import combinations
from types import SimpleNamespace

import pytest
import torch

from models.config import MoEConfig
from moe import MoELayer
from moe.hierarchical import proxy_table
from moe.nodes import expert_nodes, one_node
from parallel.mesh import rank_groups
from parallel.plan import ParallelPlan, ep_group_of, ep_group_ranks
from parallel.planner.expert_nodes import EpNodes, ep_nodes, expert_a2a_bytes, nodes_per_token


# ---- moe/nodes.py ----

@pytest.mark.parametrize("ranks, gpn, labels", [
    (range(8), 2, (0, 0, 1, 1, 2, 2, 3, 3)),
    (range(8), 4, (0, 0, 0, 0, 1, 1, 1, 1)),
    ([0, 2, 4, 6], 2, (0, 1, 2, 3)),   # etp=2 stride: one ep rank per node
    ([0, 2, 4, 6], 4, (0, 0, 1, 1)),
    ([1, 3, 5, 7], 4, (0, 0, 1, 1)),
    ([4, 5, 6, 7], 2, (0, 0, 1, 1)),   # nodes 2 and 3 relabelled 0 and 1
    ([0, 1, 4, 5], 2, (0, 0, 1, 1)),   # a gap between the nodes
    ([2, 3], 3, (0, 1)),               # straddles a node boundary, evenly
])
def test_expert_nodes_labels(ranks, gpn, labels):
    nodes = expert_nodes(ranks, gpn)
    assert nodes.node_of_rank == labels
    assert nodes.world == len(labels)
    assert nodes.num_nodes == len(set(labels))
    assert nodes.ranks_per_node == len(labels) // len(set(labels))


def test_proxies_by_hand():
    four = expert_nodes(range(8), 4)     # G = 4: nodes {0..3}, {4..7}
    assert [four.proxy(5, 0), four.proxy(2, 1), four.proxy(7, 1), four.proxy(0, 0)] == [1, 6, 7, 0]
    two = expert_nodes(range(8), 2)      # G = 2: nodes {0,1}, {2,3}, {4,5}, {6,7}
    assert [two.proxy(3, 2), two.proxy(6, 0), two.proxy(0, 3), two.proxy(5, 1)] == [5, 0, 6, 3]
    strided = expert_nodes([0, 2, 4, 6], 2)   # one rank per node: the proxy is the node's rank
    assert [strided.proxy(s, m) for s in range(4) for m in range(4)] == list(range(4)) * 4
    assert [two.node_of_expert(e, 16) for e in range(16)] == [e // 4 for e in range(16)]
    one = one_node(4)
    assert one.node_of_rank == (0, 0, 0, 0) and one.num_nodes == 1
    assert [one.proxy(s, 0) for s in range(4)] == [0, 1, 2, 3]


def test_every_proxy_lies_on_its_node_with_the_sources_local_index():
    for ranks, gpn in (([0, 1, 2, 3, 4, 5], 2), ([0, 1, 2, 3, 4, 5], 3), (range(8), 4)):
        nodes = expert_nodes(ranks, gpn)
        for s in range(nodes.world):
            for m in range(nodes.num_nodes):
                p = nodes.proxy(s, m)
                assert nodes.node_of_rank[p] == m
                assert nodes.local_index(p) == nodes.local_index(s)
                if m == nodes.node_of_rank[s]:
                    assert p == s


@pytest.mark.parametrize("ranks, gpn, match", [
    ([0, 1, 2], 2, r"has \[2, 1\] ranks on its nodes of parallel.gpus_per_node=2.*evenly"),
    ([0, 1, 2, 3, 4, 5], 4, r"has \[4, 2\] ranks"),
    ([1, 0], 2, r"\[1, 0\] are not in ascending order; build the group from parallel/mesh.py"),
    ([0, 1], 0, r"parallel.gpus_per_node=0 must be a positive integer"),
    ([0, 1], -2, r"parallel.gpus_per_node=-2 must be a positive integer"),
    ([0, 1], True, r"parallel.gpus_per_node=True must be a positive integer"),
    ([0, 1], 2.0, r"parallel.gpus_per_node=2.0 must be a positive integer"),
])
def test_expert_nodes_errors(ranks, gpn, match):
    with pytest.raises(ValueError, match=match):
        expert_nodes(ranks, gpn)


# ---- parallel/plan.py: the ep groups as pure arithmetic ----

LAYOUTS = [
    (4, dict(dp=4, ep=4)), (4, dict(dp=4, ep=2)), (4, dict(dp=2, tp=2, ep=4)),
    (4, dict(dp=4, ep=2, etp=2)), (4, dict(pp=2, dp=2, ep=2)), (4, dict(dp=2, cp=2, ep=2)),
    (8, dict(pp=2, dp=2, tp=2, ep=2, etp=2)), (8, dict(dp=4, cp=2, ep=4, etp=2)),
    (16, dict(pp=2, dp=2, tp=4, ep=2, etp=2)), (6, dict(dp=6, ep=3)),
]


@pytest.mark.parametrize("world, kw", LAYOUTS)
def test_ep_groups_match_the_mesh(world, kw):
    plan = ParallelPlan(**kw).validate(world)
    mesh = {tuple(g) for g in rank_groups(plan)["ep"]}
    groups = ep_group_ranks(plan)
    assert len(groups) == len(mesh) == world // plan.ep
    assert {tuple(g) for g in groups} == mesh
    for rank in range(world):
        mine = ep_group_of(plan, rank)
        assert rank in mine and tuple(mine) in mesh


@pytest.mark.parametrize("world, kw, node_size, rank, want", [
    (4, dict(dp=4, ep=4), 2, 3, EpNodes(4, 2, 2)),
    (4, dict(dp=4, ep=2, etp=2), 2, 1, EpNodes(2, 1, 2)),   # group [1, 3]
    (8, dict(dp=8, ep=4, etp=2), 4, 6, EpNodes(4, 2, 2)),   # group [0, 2, 4, 6]
    (8, dict(dp=8, ep=2), 4, 5, EpNodes(2, 2, 1)),          # group [4, 5]: one node
])
def test_ep_nodes_by_hand(world, kw, node_size, rank, want):
    plan = ParallelPlan(**kw).validate(world)
    assert ep_nodes(plan, rank, node_size) == want
    nodes = expert_nodes(ep_group_of(plan, rank), node_size)
    assert (nodes.world, nodes.ranks_per_node, nodes.num_nodes) == (want.ep, want.per, want.count)


# ---- moe/hierarchical.py: proxy_table ----

def test_proxy_table_by_hand():
    # P = 4 ranks, nodes {0, 1} and {2, 3}, W = 1; table[s, d] = 10 s + d + 1 rows
    table = (10 * torch.arange(4).view(4, 1) + torch.arange(4).view(1, 4) + 1).view(4, 4, 1)
    got = proxy_table(table, expert_nodes(range(4), 2))
    # rows for node 0 go through rank s % 2, rows for node 1 through 2 + s % 2
    want = torch.tensor([[1 + 21, 2 + 22, 0, 0],
                         [11 + 31, 12 + 32, 0, 0],
                         [0, 0, 3 + 23, 4 + 24],
                         [0, 0, 13 + 33, 14 + 34]]).view(4, 4, 1)
    assert torch.equal(got, want)
    assert torch.equal(got.sum(0), table.sum(0))


@pytest.mark.parametrize("P, gpn, W", [(8, 2, 3), (8, 4, 2), (6, 3, 1), (4, 4, 2)])
def test_proxy_table_against_a_loop(P, gpn, W):
    nodes = expert_nodes(range(P), gpn)
    table = torch.randint(0, 50, (P, P, W), generator=torch.Generator().manual_seed(P * W + gpn))
    want = torch.zeros_like(table)
    for s in range(P):
        for d in range(P):
            want[nodes.proxy(s, nodes.node_of_rank[d]), d] += table[s, d]
    got = proxy_table(table, nodes)
    assert torch.equal(got, want)
    assert torch.equal(got.sum(0), table.sum(0))   # every (destination, slot) gets its rows
    for p in range(P):   # hop 2 stays inside the proxy's node
        off = [d for d in range(P) if nodes.node_of_rank[d] != nodes.node_of_rank[p]]
        assert got[p, off].sum() == 0


# ---- ParallelPlan.validate: _check_nodes ----

def _moe(**kw):
    return MoEConfig(**{"num_experts": 4, "top_k": 2, **kw}).validate()


@pytest.mark.parametrize("world, plan_kw, moe_kw, match", [
    (4, dict(dp=4, ep=4, gpus_per_node=-1), {}, r"parallel.gpus_per_node=-1 must be an integer >= 0"),
    (4, dict(dp=4, ep=4, gpus_per_node=True), {}, r"parallel.gpus_per_node=True must be an integer"),
    (4, dict(dp=4, ep=4, gpus_per_node=3), {},
     r"parallel.gpus_per_node=3 does not divide the 4 ranks.*use a divisor of the world size"),
    (4, dict(dp=4), dict(dispatch="hierarchical"),
     r"moe.dispatch=hierarchical .* parallel.ep=1; set parallel.ep > 1 or leave moe.dispatch at"),
    (4, dict(dp=4), dict(max_nodes=1),
     r"moe.max_nodes=1 .* parallel.ep=1; set parallel.ep > 1 or leave moe.max_nodes at"),
    (4, dict(dp=4, ep=4), dict(dispatch="hierarchical", a2a_overlap_degree=2),
     r"moe.dispatch=hierarchical with moe.a2a_overlap_degree=2.*set moe.a2a_overlap_degree=1 or "
     r"moe.dispatch=flat"),
    (4, dict(dp=4, ep=4), dict(max_nodes=1, replica_slots=1),
     r"moe.max_nodes=1 with moe.replica_slots=1.*set one of them to 0"),
    (6, dict(dp=6, ep=3, gpus_per_node=2), dict(num_experts=6, dispatch="hierarchical"),
     r"global ranks \[0, 1, 2\]\) has \[2, 1\] ranks.*parallel.gpus_per_node=2"),
    (4, dict(dp=4, ep=4, gpus_per_node=2), dict(top_k=3, max_nodes=1),
     r"moe.max_nodes=1: top_k=3 is more than the 2 experts on 1 of the 2 expert nodes; raise "
     r"max_nodes \(the experts span 2 nodes"),
    (4, dict(dp=4, ep=4, gpus_per_node=2), dict(num_experts=12, n_group=3, topk_group=1, max_nodes=1),
     r"moe.max_nodes=1 with n_group=3 .* use n_group a multiple of 2"),
    # groups [0, 1] and [4, 5] lie on one node, [2, 3] spans two: the limit would route
    # differently on different groups (edp copies), refused
    (6, dict(dp=6, ep=2, gpus_per_node=3), dict(num_experts=2, max_nodes=1),
     r"moe.max_nodes=1: the expert-parallel groups span \[1, 2\] nodes of parallel.gpus_per_node=3"),
])
def test_plan_node_errors(world, plan_kw, moe_kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelPlan(**plan_kw).validate(world, moe_cfg=_moe(**moe_kw))


def test_plan_node_layouts_that_pass():
    moe = _moe(dispatch="hierarchical", max_nodes=1)
    plan = ParallelPlan(dp=4, ep=4, gpus_per_node=2).validate(4, moe_cfg=moe)
    assert plan.gpus_per_node == 2 and "gpus_per_node=2" in plan.summary()
    assert expert_nodes(ep_group_ranks(plan)[0], 2).node_of_rank == (0, 0, 1, 1)
    # max_nodes >= the nodes the experts span does not bind, whatever top_k
    ParallelPlan(dp=4, ep=4, gpus_per_node=2).validate(4, moe_cfg=_moe(top_k=4, max_nodes=2))
    # the ep group on one node: no node limit to check
    ParallelPlan(dp=4, ep=2, gpus_per_node=2).validate(4, moe_cfg=_moe(top_k=4, max_nodes=1))
    # a dense model skips the MoE checks
    ParallelPlan(dp=4, gpus_per_node=3).validate(4, moe_cfg=MoEConfig(every=0, max_nodes=1))


# ---- models/config.py MoEConfig ----

@pytest.mark.parametrize("kw, match", [
    (dict(dispatch="tree"), r"moe.dispatch='tree' is not supported; use one of \['flat', 'hierarchical'\]"),
    (dict(max_nodes=-1), r"moe.max_nodes=-1 must be an integer >= 0 \(0 = no limit\)"),
    (dict(max_nodes=True), r"moe.max_nodes=True must be an integer >= 0"),
    (dict(max_nodes=1.0), r"moe.max_nodes=1.0 must be an integer >= 0"),
    (dict(max_nodes=2, router="expert_choice"),
     r"moe.max_nodes=2 .* needs moe.router='token_choice'; set moe.max_nodes=0"),
])
def test_moe_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kw).validate()


def test_moe_config_routing_kwargs_carry_dispatch_and_max_nodes():
    default = MoEConfig().validate().routing_kwargs()
    assert default["dispatch"] == "flat" and default["max_nodes"] is None
    set_ = MoEConfig(dispatch="hierarchical", max_nodes=2).validate().routing_kwargs()
    assert set_["dispatch"] == "hierarchical" and set_["max_nodes"] == 2
    layer = MoELayer(d_model=8, d_ff=16, num_experts=8, top_k=2, **set_)
    assert layer.dispatch == "hierarchical" and layer.router.config.max_nodes == 2


# ---- parallel/planner/expert_nodes.py ----

def brute_nodes_per_token(E, K, n, M=None):
    """Mean distinct nodes over every K-set of experts (uniform); under M < n over every M-node
    subset and every K-set of its experts (uniform over the pairs)."""
    size = E // n
    subsets = [tuple(range(n))] if M is None or M >= n else list(combinations(range(n), M))
    counts = [len({e // size for e in ks}) for nodes in subsets
              for ks in combinations([e for e in range(E) if e // size in nodes], K)]
    return sum(counts) / len(counts)


@pytest.mark.parametrize("E, K, n, M", [
    (8, 2, 2, None), (8, 3, 2, None), (8, 2, 4, None), (8, 3, 4, None), (12, 4, 3, None),
    (8, 2, 4, 1), (8, 2, 4, 2), (8, 3, 4, 2), (8, 3, 4, 3), (8, 3, 2, 1), (12, 3, 3, 2),
    (16, 4, 8, 3), (8, 2, 4, 4), (8, 2, 4, 6),
])
def test_nodes_per_token_against_enumeration(E, K, n, M):
    w = SimpleNamespace(moe_cfg=MoEConfig(num_experts=E, top_k=K, max_nodes=M or 0).validate(),
                        nodes_per_token=0)
    got = nodes_per_token(w, EpNodes(ep=n, per=1, count=n))
    assert got == pytest.approx(brute_nodes_per_token(E, K, n, M), rel=1e-12)
    assert 1 <= got <= min(K, n, M or n)


def test_nodes_per_token_one_node_and_measured():
    w = SimpleNamespace(moe_cfg=MoEConfig(num_experts=8, top_k=4).validate(), nodes_per_token=0)
    assert nodes_per_token(w, EpNodes(ep=4, per=4, count=1)) == 1.0
    measured = SimpleNamespace(moe_cfg=w.moe_cfg, nodes_per_token=1.37)
    assert nodes_per_token(measured, EpNodes(ep=4, per=2, count=2)) == 1.37


def test_nodes_per_token_over_more_nodes_than_experts():
    """The search bounds structures before validation refuses them: an ep group over 16
    nodes with 8 experts (Mixtral at world 1024) has each expert on a node of its own, so a
    token's K experts lie on K nodes (it divided by zero)."""
    w = SimpleNamespace(moe_cfg=MoEConfig(num_experts=8, top_k=2).validate(), nodes_per_token=0)
    assert nodes_per_token(w, EpNodes(ep=16, per=1, count=16)) == 2.0


ROWS = (100, 200, 300)   # d, c, b bytes per row
TWO_NODES = EpNodes(ep=4, per=2, count=2)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("nodes", [TWO_NODES, EpNodes(8, 2, 4), EpNodes(4, 4, 1)])
def test_flat_bytes(passes, nodes):
    T, A, r, E = 10, 20, 1.5, 8
    N, (d, c, b) = r * A, ROWS
    total = passes * (A * d + N * c + nodes.ep * E * 8) + (A + N) * b
    f = nodes.per / nodes.ep
    intra, inter = expert_a2a_bytes("flat", T, A, r, 1.5, nodes, E, ROWS, passes)
    assert intra == pytest.approx(total * f) and inter == pytest.approx(total * (1 - f))


def test_hierarchical_bytes_by_hand():
    # T=10 tokens, A=20 assignments, N=30 rows received, nu=1.5: U = min(15, 20) = 15
    # across as f/(1-f) = 1/2: 15*100 + 15*200 + 20*8 + 4*8 + 4*8*8 = 4948 forward,
    #   + 2*15*300 + 20*4 = 9080 backward = 14028
    # inside only: 20*100 + 30*200 + 50*300 = 23000
    intra, inter = expert_a2a_bytes("hierarchical", 10, 20, 1.5, 1.5, TWO_NODES, 8, ROWS, 1)
    assert (intra, inter) == (pytest.approx(14028 / 2 + 23000), pytest.approx(14028 / 2))
    # recomputation doubles the forward terms: 2*4948 + 9080 and 2*8000 + 15000
    intra, inter = expert_a2a_bytes("hierarchical", 10, 20, 1.5, 1.5, TWO_NODES, 8, ROWS, 2)
    assert (intra, inter) == (pytest.approx(18976 / 2 + 31000), pytest.approx(18976 / 2))
    flat_inter = expert_a2a_bytes("flat", 10, 20, 1.5, 1.5, TWO_NODES, 8, ROWS, 1)[1]
    assert inter < flat_inter


@pytest.mark.parametrize("tokens, nu", [(10, 2.0), (10, 3.0), (25, 1.0)])
def test_hierarchical_bytes_when_no_token_shares_a_node(tokens, nu):
    """nu T >= A: U = A, every assignment its own row on hop 1."""
    A, r, E, (d, c, b), P = 20, 1.25, 8, ROWS, TWO_NODES.ep
    N = r * A
    spread = A * (d + c) + 8 * A + 8 * P + 8 * P * E + 2 * A * b + 4 * A
    inside = A * d + N * c + (A + N) * b
    intra, inter = expert_a2a_bytes("hierarchical", tokens, A, r, nu, TWO_NODES, E, ROWS, 1)
    assert intra + inter == pytest.approx(spread + inside)
    assert inter == pytest.approx(spread / 2)


# ---- moe/layer.py ----

def test_layer_rejects_an_unknown_dispatch():
    with pytest.raises(ValueError, match=r"dispatch='bogus' \(moe.dispatch\) is not supported"):
        MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2, dispatch="bogus")


def test_layer_repr_and_summary_name_dispatch_and_max_nodes():
    plain = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2)
    assert "dispatch=" not in repr(plain) and "max_nodes" not in repr(plain)
    assert "dispatch=" not in plain.routing_summary() and "max_nodes" not in plain.routing_summary()
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2, dispatch="hierarchical", max_nodes=1)
    assert "dispatch=hierarchical" in repr(layer) and "max_nodes=1" in repr(layer)
    summary = layer.routing_summary()
    assert "dispatch=hierarchical" in summary and summary.endswith("max_nodes=1")
    layer.router.config = dataclasses.replace(layer.router.config, expert_nodes=2)  # as the layout sets it
    assert layer.routing_summary().endswith("max_nodes=1 of the experts' 2 nodes")


def test_layer_node_setup_needs_sharding_and_flat_timeline():
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2, dispatch="hierarchical")
    with pytest.raises(ValueError, match=r"set_expert_nodes: shard the layer first \(set_ep_group\)"):
        layer.set_expert_nodes(one_node(2))
    with pytest.raises(ValueError, match=r"profile with moe.dispatch=flat"):
        layer.set_timeline(object())
    layer.set_timeline(None)   # stopping is always allowed
    assert layer.timeline is None
