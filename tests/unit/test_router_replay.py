"""Router replay at the layer level (MoELayer(x, expert_ids=...), issue 33 part 4): after the
router's weights change, a replayed forward routes to the recorded experts, with gates from
the current scores at them; outputs and every gradient equal a per-token reference that
forces the same experts by hand (fp64, 1e-10)."""
import pytest
import torch

from moe import MoELayer
from moe.capacity import expert_capacity
from tests.unit.reference import expert_ffn, router_probs

TOL = dict(rtol=1e-10, atol=1e-10)


def _layer():
    torch.manual_seed(0)
    return MoELayer(16, 32, 8, top_k=2, norm_topk_prob=True).double()


def _forced_by_hand(layer, x, ids):
    """y[t] = sum_k g_tk expert_{ids[t, k]}(x[t]), g = the current scores at ids, renormalised."""
    x_TD = x.reshape(-1, x.shape[-1])
    _, probs_TE = router_probs(layer, x_TD)
    rows = []
    for t, choice in enumerate(ids.reshape(-1, layer.top_k).tolist()):
        g = probs_TE[t, choice]
        g = g / g.sum()
        rows.append(sum(g[k] * expert_ffn(layer.experts, e, x_TD[t]) for k, e in enumerate(choice)))
    return torch.stack(rows).reshape(x.shape)


def test_replay_routes_to_the_recorded_experts_and_equals_forced_routing():
    layer = _layer()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    recorded = layer.router(x, None).ids_GSK          # what a rollout chose
    with torch.no_grad():                             # training moved the router since
        layer.router.weight.add_(torch.randn_like(layer.router.weight))
    assert not torch.equal(layer.router(x, None).ids_GSK, recorded)

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = layer(x1, expert_ids=recorded)
    ref = _forced_by_hand(layer, x2, recorded)
    torch.testing.assert_close(y, ref, **TOL)
    assert torch.equal(layer.last_stats.routed_E, torch.bincount(recorded.reshape(-1), minlength=8))

    w = torch.randn_like(y)
    params = [layer.router.weight, *layer.experts.parameters()]
    got = torch.autograd.grad((y * w).sum(), [x1, *params], allow_unused=True)
    want = torch.autograd.grad((ref * w).sum(), [x2, *params], allow_unused=True)
    for g, r, p in zip(got, want, [x1, *params]):  # None: unused (an expert nobody reached)
        zero = torch.zeros_like(p)
        torch.testing.assert_close(zero if g is None else g, zero if r is None else r, **TOL)
    assert got[1].abs().sum() > 0  # the router learns through the replayed gates


def test_replay_under_capacity_drops_as_for_chosen_experts():
    layer = _layer()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    ids = torch.zeros(2, 8, 2, dtype=torch.long)      # every token to experts 0 and 1
    ids[..., 1] = 1
    routing = layer.router(x, 0.5, ids)
    kept = torch.bincount(routing.expert_A, minlength=9)[:8]  # id 8: dropped
    cap = expert_capacity(0.5, 8, 2, 8)
    assert kept[0] == kept[1] == 2 * cap and kept[2:].sum() == 0  # 2 groups, capacity each
    assert torch.equal(routing.kept_E, kept)


@pytest.mark.parametrize("ids, match", [
    (torch.zeros(3, 5, 3, dtype=torch.long), "do not match 15 tokens x top_k=2"),
    (torch.full((3, 5, 2), 8), r"integers in \[0, 8\)"),
    (torch.zeros(3, 5, 2), r"integers in \[0, 8\)"),
])
def test_bad_replay_ids_name_the_problem(ids, match):
    with pytest.raises(ValueError, match=match):
        _layer()(torch.randn(3, 5, 16, dtype=torch.float64), expert_ids=ids)


def test_replay_needs_token_choice():
    layer = MoELayer(16, 32, 8, top_k=2, router="expert_choice").double()
    with pytest.raises(ValueError, match="needs token-choice routing"):
        layer(torch.randn(2, 4, 16, dtype=torch.float64), expert_ids=torch.zeros(2, 4, 2, dtype=torch.long))
