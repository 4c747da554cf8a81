"""Router: gate semantics, expert choice, aux-loss-free bias, jitter, dtypes.

Shapes: G routing groups, S tokens per group, D model dim, E experts, K top-k, C capacity.
"""
import math

import pytest
import torch

from moe import MoELayer, Router, RoutingConfig

G, S, D, E = 2, 8, 6, 5


def make_router(k, kind="token_choice", jitter=0.0, seed=0):
    torch.manual_seed(seed)
    r = Router(D, RoutingConfig(num_experts=E, top_k=k, kind=kind, jitter=jitter)).double()
    with torch.no_grad():
        r.weight.normal_(0, 1.0)
    return r


def naive_choices(probs_SE, k, bias_E):
    """Per token: ids by descending (prob + bias), gates from the unbiased probs."""
    out = []
    for p in probs_SE.detach():
        ids = sorted(range(E), key=lambda e: -float(p[e] + bias_E[e]))[:k]
        gates = [float(p[e]) for e in ids]
        if k > 1:
            gates = [gt / sum(gates) for gt in gates]
        out.append((ids, gates))
    return out


def routing_table(routing, k):
    """{slot: (expert, gate)} from a token-choice Routing."""
    return {int(s): (int(e), float(g)) for s, e, g in
            zip(routing.slot_A, routing.expert_A, routing.gate_A.detach())}


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_token_choice_ids_and_gates(k):
    r = make_router(k)
    x = torch.randn(G, S, D, dtype=torch.float64)
    table = routing_table(r(x, None), k)
    probs = torch.softmax(x.reshape(-1, D) @ r.weight.t(), -1)
    for t, (ids, gates) in enumerate(naive_choices(probs, k, torch.zeros(E))):
        for kk in range(k):
            e, g = table[t * k + kk]
            assert e == ids[kk] and g == pytest.approx(gates[kk], rel=1e-12)
    if k == 1:  # Switch: the gate is the raw probability, not 1.0
        assert all(g < 1.0 for _, g in table.values())


def test_selection_bias_changes_selection_not_gates():
    r = make_router(2)
    x = torch.randn(G, S, D, dtype=torch.float64)
    before = routing_table(r(x, None), 2)
    with torch.no_grad():
        r.selection_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0]))  # favour expert 4
    after = routing_table(r(x, None), 2)
    assert before != after
    assert all(4 in (after[2 * t][0], after[2 * t + 1][0]) for t in range(G * S))
    probs = torch.softmax(x.reshape(-1, D) @ r.weight.t(), -1)
    for t, (ids, gates) in enumerate(naive_choices(probs, 2, r.selection_bias)):
        got = [after[2 * t + kk] for kk in range(2)]
        assert [e for e, _ in got] == ids
        assert [g for _, g in got] == pytest.approx(gates, rel=1e-12)  # unbiased probabilities


def test_update_selection_bias_moves_toward_underloaded_experts():
    r = make_router(1)
    with torch.no_grad():
        r.selection_bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0]))  # everything to 0
    x = torch.randn(G, S, D, dtype=torch.float64)
    r.train()
    r(x, None)
    r(x, None)
    assert r.pending_load.tolist() == [2.0 * G * S, 0, 0, 0, 0]
    r.update_selection_bias(0.25)
    assert r.selection_bias.tolist() == [0.75, 0.25, 0.25, 0.25, 0.25]
    assert r.pending_load.sum() == 0  # consumed
    r.update_selection_bias(0.25)  # nothing pending: no move
    assert r.selection_bias.tolist() == [0.75, 0.25, 0.25, 0.25, 0.25]
    r.update_selection_bias(0.5, load_E=torch.tensor([1.0, 1.0, 1.0, 1.0, 6.0]))  # explicit load
    assert r.selection_bias.tolist() == [1.25, 0.75, 0.75, 0.75, -0.25]
    r.eval()
    r(x, None)
    assert r.pending_load.sum() == 0  # eval forwards do not count toward balancing


@pytest.mark.parametrize("k,cf", [(1, 1.0), (2, 1.0), (2, 0.5), (1, 3.0), (2, None)])
def test_expert_choice_every_expert_takes_exactly_its_capacity(k, cf):
    r = make_router(k, "expert_choice")
    x = torch.randn(G, S, D, dtype=torch.float64)
    routing = r(x, cf)
    C = min(S, math.ceil((cf or 1.0) * S * k / E))
    assert torch.equal(routing.kept_E, torch.full((E,), G * C))
    probs = torch.softmax(x @ r.weight.t(), -1)
    for g in range(G):
        for e in range(E):
            mask = (routing.expert_A == e) & (routing.token_A // S == g)
            toks = (routing.token_A[mask] % S).tolist()
            assert len(set(toks)) == C
            want = probs[g, :, e].topk(C).indices.tolist()
            assert sorted(toks) == sorted(want)
            torch.testing.assert_close(routing.gate_A[mask], probs[g, toks, e])


def test_jitter_only_in_training():
    r = make_router(2, jitter=0.5)
    x = torch.randn(G, S, D, dtype=torch.float64)
    r.eval()
    assert torch.equal(r.logits(x.reshape(-1, D)), r.logits(x.reshape(-1, D)))
    r.train()
    torch.manual_seed(3)
    a = r.logits(x.reshape(-1, D))
    b = r.logits(x.reshape(-1, D))
    assert not torch.equal(a, b)
    plain = x.reshape(-1, D) @ r.weight.t()
    assert (a - plain).abs().max() > 0


@pytest.mark.lowp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_router_is_fp32_for_low_precision(dtype):
    layer = MoELayer(D, 4, E, 2).to(dtype)
    routing = layer.router(torch.randn(G, S, D).to(dtype), None)
    assert routing.gate_A.dtype == torch.float32
    layer(torch.randn(G, S, D).to(dtype))
    assert layer.aux_loss.dtype == torch.float32
