"""Node-limited routing (DeepSeek-V3: each token's experts on at most M nodes): moe/scoring.py's
node_keep_mask / select_experts against hand-computed ids and a naive per-token loop, the
RoutingConfig checks, the Router, and the load profiler's nodes per token.

Shapes: T tokens, E experts, K top-k, n nodes (contiguous blocks of E/n experts), M max_nodes,
N groups (n_group), G routing groups, S tokens per group, D model dim.
"""
import dataclasses
import io

import pytest
import torch
import torch.nn as nn

from moe import MoELayer
from moe.config import RoutingConfig
from moe.profiling import profile_model
from moe.profiling.load import tokens_by_nodes
from moe.router import Router
from moe.scoring import node_keep_mask, scores_from_logits, select_experts

NO_BIAS = torch.zeros(1)


def random_choice(T, E, seed, score_func="sigmoid"):
    """(scores_TE, bias_E): random scores and a selection bias of a comparable size."""
    g = torch.Generator().manual_seed(seed)
    scores_TE = scores_from_logits(torch.randn(T, E, generator=g, dtype=torch.float64), score_func)
    return scores_TE, 0.1 * torch.randn(E, generator=g, dtype=torch.float64)


def nodes_of(ids_TK, E, n):
    return [{e // (E // n) for e in row} for row in ids_TK.tolist()]


def naive_ids(choice_E, E, K, n=1, M=None, n_group=1, topk_group=1):
    """The definition, one token, plain Python: keep the M nodes with the best sum of their top
    max(1, K // M) scores (capped at E/n), then the topk_group groups with the best sum of their
    top-2 among what is left (-inf elsewhere), then the top K. Returns the set of ids."""
    c = [float(v) for v in choice_E]
    if M is not None and M < n:
        size = E // n
        per = min(max(1, K // M), size)
        score = [sum(sorted(c[k * size:(k + 1) * size], reverse=True)[:per]) for k in range(n)]
        kept = sorted(range(n), key=lambda k: -score[k])[:M]
        c = [v if e // size in kept else float("-inf") for e, v in enumerate(c)]
    if n_group > 1:
        size = E // n_group
        score = [sum(sorted(c[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -score[g])[:topk_group]
        c = [v if e // size in kept else float("-inf") for e, v in enumerate(c)]
    return set(sorted(range(E), key=lambda e: -c[e])[:K])


def test_hand_computed_node_limit():
    # E=8 on 4 nodes of 2, K=2, M=1: per_node = 2. Plain top-2 is {0, 2} (nodes 0 and 1);
    # node scores: n0 = .9 + .05 = .95, n1 = .8 + .3 = 1.1, n2 = .8, n3 = .5 -> node 1 alone
    scores = torch.tensor([[0.9, 0.05, 0.8, 0.3, 0.1, 0.7, 0.2, 0.3]])
    assert select_experts(scores, NO_BIAS, 2).tolist() == [[0, 2]]
    assert node_keep_mask(scores, 4, 1, 2).tolist() == [[False, False, True, True] + [False] * 4]
    assert select_experts(scores, NO_BIAS, 2, expert_nodes=4, max_nodes=1).tolist() == [[2, 3]]
    # M=2: per_node = 1, node scores are the best expert: n0 = .9, n1 = .8 -> plain top-2 fits
    assert select_experts(scores, NO_BIAS, 2, expert_nodes=4, max_nodes=2).tolist() == [[0, 2]]
    # the bias moves the choice, not only the gates: +0.5 on expert 5 makes node 2 the best
    bias = torch.tensor([0, 0, 0, 0, 0, 0.5, 0, 0])
    assert select_experts(scores, bias, 2, expert_nodes=4, max_nodes=1).tolist() == [[5, 4]]


@pytest.mark.parametrize("E,n,K,M", [(8, 4, 2, 1), (16, 4, 4, 2), (16, 8, 6, 3), (32, 4, 8, 2),
                                     (64, 8, 8, 4), (12, 3, 5, 2), (8, 8, 3, 3)])
def test_no_token_exceeds_max_nodes(E, n, K, M):
    scores_TE, bias_E = random_choice(200, E, seed=E + n + K + M)
    ids_TK = select_experts(scores_TE, bias_E, K, expert_nodes=n, max_nodes=M)
    assert ids_TK.shape == (200, K)
    assert all(len(set(row)) == K for row in ids_TK.tolist())
    assert max(len(s) for s in nodes_of(ids_TK, E, n)) <= M
    choice_TE = scores_TE + bias_E
    for t in range(0, 200, 17):
        assert set(ids_TK[t].tolist()) == naive_ids(choice_TE[t], E, K, n, M)


@pytest.mark.parametrize("M", [4, 5, 100])
def test_max_nodes_at_or_above_nodes_is_plain_top_k(M):
    scores_TE, bias_E = random_choice(100, 16, seed=M, score_func="softmax")
    plain = select_experts(scores_TE, bias_E, 3)
    assert torch.equal(select_experts(scores_TE, bias_E, 3, expert_nodes=4, max_nodes=M), plain)
    assert torch.equal(select_experts(scores_TE, bias_E, 3, expert_nodes=1, max_nodes=1), plain)


@pytest.mark.parametrize("E,n,K,M", [(16, 8, 8, 4), (32, 4, 4, 2), (24, 6, 6, 3)])
def test_two_per_node_equals_group_limited_routing(E, n, K, M):
    # top_k / max_nodes = 2: the node score is the group score of n_group=n, topk_group=M
    scores_TE, bias_E = random_choice(150, E, seed=E * K)
    by_nodes = select_experts(scores_TE, bias_E, K, expert_nodes=n, max_nodes=M)
    by_groups = select_experts(scores_TE, bias_E, K, n_group=n, topk_group=M)
    assert torch.equal(by_nodes, by_groups)


@pytest.mark.parametrize("E,n,K,M,N,topk_group", [(32, 4, 4, 2, 8, 3), (32, 2, 6, 1, 8, 3),
                                                   (64, 8, 8, 4, 16, 5), (16, 4, 2, 1, 8, 1)])
def test_composed_with_groups_inside_nodes(E, n, K, M, N, topk_group):
    scores_TE, bias_E = random_choice(120, E, seed=E + N)
    ids_TK = select_experts(scores_TE, bias_E, K, n_group=N, topk_group=topk_group,
                            expert_nodes=n, max_nodes=M)
    choice_TE = scores_TE + bias_E
    node_TE = node_keep_mask(choice_TE, n, M, K)
    for t, row in enumerate(ids_TK.tolist()):
        assert len({e // (E // n) for e in row}) <= M
        assert len({e // (E // N) for e in row}) <= topk_group
        assert all(node_TE[t, e] for e in row)
        if t % 11 == 0:
            assert set(row) == naive_ids(choice_TE[t], E, K, n, M, N, topk_group)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(max_nodes=0), r"max_nodes=0 must be None"),
    (dict(max_nodes=True), r"max_nodes=True must be None"),
    (dict(max_nodes=1.5), r"max_nodes=1.5 must be None"),
    (dict(max_nodes=2, kind="expert_choice", top_k=1), r"max_nodes=2 .*router='token_choice'"),
    (dict(expert_nodes=3), r"expert_nodes=3 must be an integer >= 1 dividing num_experts=8"),
    (dict(expert_nodes=0), r"expert_nodes=0 must be"),
    (dict(expert_nodes=True), r"expert_nodes=True must be"),
    (dict(top_k=3, max_nodes=1, expert_nodes=4), r"max_nodes=1: top_k=3 is more than the 2 "
                                                 r"experts .*raise max_nodes"),
    (dict(max_nodes=1, expert_nodes=4, n_group=2),
     r"max_nodes=1 with n_group=2 .*n_group a multiple of 4"),
])
def test_config_errors_name_the_field(kwargs, msg):
    base = dict(num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=msg):
        RoutingConfig(**{**base, **kwargs})


def test_config_accepts_what_the_layout_may_set_later():
    cfg = RoutingConfig(num_experts=8, top_k=4, max_nodes=2)      # one node: no limit yet
    assert (cfg.max_nodes, cfg.expert_nodes) == (2, 1)
    assert dataclasses.replace(cfg, expert_nodes=2).expert_nodes == 2   # M >= n
    assert dataclasses.replace(cfg, expert_nodes=4).expert_nodes == 4   # 4 <= 2 * 8/4
    with pytest.raises(ValueError, match="raise max_nodes"):
        dataclasses.replace(cfg, expert_nodes=8)                 # 4 > 2 * 8/8
    ok = RoutingConfig(num_experts=16, top_k=4, max_nodes=2, expert_nodes=4, n_group=8,
                       topk_group=3)
    assert ok.topk_group == 3


@pytest.mark.parametrize("score_func,norm", [("softmax", True), ("sigmoid", False),
                                             ("sigmoid", True)])
def test_router_gates_are_unbiased_scores_at_node_limited_ids(score_func, norm):
    G, S, D, E, n, K, M = 3, 10, 8, 16, 4, 4, 2
    torch.manual_seed(0)
    router = Router(D, RoutingConfig(num_experts=E, top_k=K, score_func=score_func,
                                     norm_topk_prob=norm, max_nodes=M, expert_nodes=n,
                                     routed_scaling_factor=2.0))
    with torch.no_grad():
        router.selection_bias.copy_(0.1 * torch.randn(E))
    x_GSD = torch.randn(G, S, D, dtype=torch.float64)
    routing = router(x_GSD, None)
    ids_TK = routing.ids_GSK.reshape(-1, K)
    assert max(len(s) for s in nodes_of(ids_TK, E, n)) <= M
    scores_TE = scores_from_logits(x_GSD.reshape(-1, D) @ router.weight.detach().double().t(),
                                   score_func)
    choice_TE = scores_TE + router.selection_bias.double()
    for t in range(G * S):
        assert set(ids_TK[t].tolist()) == naive_ids(choice_TE[t], E, K, n, M)
    want_TK = scores_TE.gather(1, ids_TK)
    if norm:
        want_TK = want_TK / want_TK.sum(1, keepdim=True)
    gates_TK = torch.zeros(G * S * K, dtype=routing.gate_A.dtype)
    gates_TK[routing.slot_A] = routing.gate_A.detach()
    torch.testing.assert_close(gates_TK.reshape(-1, K), 2.0 * want_TK)


def test_tokens_by_nodes_hand_count():
    # E=8 on 4 nodes of 2: {0,1} -> node 0; {0,2} -> nodes 0,1; {1,7} -> 0,3; {6,7} -> 3;
    # {2,4,6} (K=3 below) -> 1,2,3
    ids_GSK = torch.tensor([[[0, 1], [0, 2]], [[1, 7], [6, 7]]])
    assert tokens_by_nodes(ids_GSK, 8, 4).tolist() == [0, 2, 2, 0, 0]
    assert tokens_by_nodes(torch.tensor([[[2, 4, 6]]]), 8, 4).tolist() == [0, 0, 0, 1, 0]


def test_profiler_reports_nodes_per_token_from_the_routed_ids():
    from commands.profile import declare_expert_nodes, print_summary
    V, D, E, K, n = 40, 8, 8, 2, 4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, D), MoELayer(D, 12, E, top_k=K),
                          MoELayer(D, 12, E, top_k=K))
    batches = [torch.randint(0, V, (2, 9)) for _ in range(3)]
    assert profile_model(model, batches)["layers"][0]["nodes_per_token"] is None   # one node
    declare_expert_nodes(model, n)
    limited = model[2].router
    limited.config = dataclasses.replace(limited.config, max_nodes=1)
    seen = {1: [], 2: []}   # the ids each layer chose, recorded independently
    hooks = [model[i].router.register_forward_hook(
        lambda m, a, r, i=i: seen[i].append(r.ids_GSK.reshape(-1, K))) for i in (1, 2)]
    report = profile_model(model, batches)
    for h in hooks:
        h.remove()
    free, capped = (r["nodes_per_token"] for r in report["layers"])
    per_token = [len({e // 2 for e in row}) for row in torch.cat(seen[1]).tolist()]
    assert free["tokens"] == [per_token.count(c) for c in range(1, n + 1)]
    assert free["max"] == max(per_token) == 2
    assert free["mean"] == pytest.approx(sum(per_token) / len(per_token))
    assert (free["expert_nodes"], free["max_nodes"]) == (n, None)
    assert capped == {"expert_nodes": n, "max_nodes": 1, "mean": 1.0, "max": 1,
                      "tokens": [2 * 9 * 3, 0, 0, 0]}
    assert all(len({e // 2 for e in row}) == 1 for row in torch.cat(seen[2]).tolist())
    out = io.StringIO()
    print_summary(report, out)
    assert "nodes per token (of 4, max_nodes=1): mean 1.00, max 1" in out.getvalue()
    with pytest.raises(ValueError, match="--nodes=3 for layer 1: expert_nodes=3"):
        declare_expert_nodes(model, 3)


def test_nodes_per_token_where_the_allowed_nodes_hold_fewer_than_top_k_experts():
    """The search's bound meets structures validation refuses: 256 experts over 256 nodes, a
    token's 8 experts allowed on 4 nodes. The count is the fewest nodes holding 8 experts
    (was: a division by zero that stopped the search)."""
    from types import SimpleNamespace

    from parallel.planner.expert_nodes import EpNodes, nodes_per_token
    w = SimpleNamespace(nodes_per_token=0,
                        moe_cfg=SimpleNamespace(num_experts=256, top_k=8, max_nodes=4))
    assert nodes_per_token(w, EpNodes(ep=256, per=1, count=256)) == 8.0
    assert nodes_per_token(w, EpNodes(ep=256, per=2, count=128)) == 4.0  # reach 8 = K: all 4
