"""Balance-loss variants (moe/losses.py) against naive per-token formulas, one process.

Shapes: G routing groups, S tokens per group, D model dim, E experts, K top-k.
"""
import pytest
import torch

from moe import MoELayer
from tests.unit.reference import router_probs, token_choice_assignments
from tests.unit.test_layer import make_layer

G, S, D, E = 3, 5, 8, 6


def x64(seed=0, g=G):
    return torch.randn(g, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def naive_terms(layer, x, mask=None):
    """Per token t: P row (balance probabilities) and the chosen experts, from the reference."""
    _, scores = router_probs(layer, x.reshape(-1, D))
    if layer.router.config.score_func == "sigmoid":
        scores = scores / scores.sum(-1, keepdim=True)
    _, choices = token_choice_assignments(layer, scores.reshape(*x.shape[:2], E).detach(), None)
    rows = []
    for g in range(x.shape[0]):
        for s in range(S):
            if mask is None or bool(mask[g, s]):
                rows.append((g, scores[g * S + s], [e for e, _ in choices[g][s]]))
    return rows


def naive_pooled(rows, K, counts_rows=None):
    """E * sum_e f_e P_e with f over counts_rows (default rows), P over rows."""
    counts_rows = rows if counts_rows is None else counts_rows
    f = [sum(ids.count(e) for _, _, ids in counts_rows) / (K * len(counts_rows)) for e in range(E)]
    P = [sum(p[e] for _, p, _ in rows) / len(rows) for e in range(E)]
    return E * sum(f[e] * P[e] for e in range(E))


def naive_sequence(rows, K):
    groups = sorted({g for g, _, _ in rows})
    return sum(naive_pooled([r for r in rows if r[0] == g], K) for g in groups) / len(groups)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("variant", ["sequence", "micro_batch", "global_batch"])
@pytest.mark.parametrize("masked", [False, True])
def test_variant_value_and_gradient_match_naive(variant, score_func, masked):
    layer = make_layer(2, balance_loss=variant, score_func=score_func)
    x = x64()
    mask = None
    if masked:  # padding at the end of sequences, one sequence all padding
        mask = torch.ones(G, S, dtype=torch.bool)
        mask[0, 3:] = False
        mask[2, :] = False
    layer.eval()  # global_batch without a window in eval: this forward only
    layer(x, token_mask=mask)
    got = layer.aux_losses["load_balance"]
    rows = naive_terms(layer, x, mask)
    want = naive_sequence(rows, 2) if variant == "sequence" else naive_pooled(rows, 2)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    g1 = torch.autograd.grad(got, layer.router.weight)[0]
    g2 = torch.autograd.grad(want, layer.router.weight)[0]
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-13)


def test_sigmoid_sequence_is_deepseek_v3_sequence_wise_loss():
    """DeepSeek-V3: L = sum_i f_i P_i, f_i = E/(K T) * #{t: i in topk(t)}, P_i = mean_t s'_it,
    s' = sigmoid scores normalised over experts; per sequence of T tokens, mean over sequences."""
    layer = make_layer(3, score_func="sigmoid", norm_topk_prob=True)
    x = x64(1)
    layer(x)
    s = torch.sigmoid(x @ layer.router.weight.t())
    s_norm = s / s.sum(-1, keepdim=True)
    ids = torch.topk(s, 3, dim=-1).indices  # no selection bias, no groups
    total = 0
    for g in range(G):
        f = torch.zeros(E, dtype=torch.float64)
        for t in range(S):
            f[ids[g, t]] += E / (3 * S)
        total = total + (f * s_norm[g].mean(0)).sum()
    assert float(layer.aux_losses["load_balance"].detach()) == pytest.approx(float((total / G).detach()), rel=1e-12)


def test_global_batch_window_accumulates_until_reset():
    layer = make_layer(2, balance_loss="global_batch").train()
    xa, xb = x64(1), x64(2)
    layer(xa)
    first = layer.aux_losses["load_balance"]
    assert float(first.detach()) == pytest.approx(float(naive_pooled(naive_terms(layer, xa), 2).detach()), rel=1e-12)
    layer(xb)  # f over both forwards, P over this one
    rows_a, rows_b = naive_terms(layer, xa), naive_terms(layer, xb)
    want = naive_pooled(rows_b, 2, counts_rows=rows_a + rows_b)
    assert float(layer.aux_losses["load_balance"].detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    assert int(layer.balance.window[-1]) == 2 * G * S
    layer.reset_balance_window()
    layer(xb)
    assert float(layer.aux_losses["load_balance"].detach()) == pytest.approx(float(naive_pooled(rows_b, 2).detach()), rel=1e-12)
    layer.eval()
    layer(xa)
    assert int(layer.balance.window[-1]) == G * S  # eval forwards leave the window alone


def test_default_is_unchanged_and_mask_errors():
    layer = make_layer(2)
    x = x64()
    layer(x)
    plain = layer.aux_losses["load_balance"]
    layer(x, token_mask=torch.ones(G, S, dtype=torch.bool))
    assert torch.equal(layer.aux_losses["load_balance"], plain)
    with pytest.raises(ValueError, match="token_mask has shape"):
        layer(x, token_mask=torch.ones(G * S, dtype=torch.bool))


@pytest.mark.parametrize("kwargs,msg", [(dict(balance_loss="batch"), "balance_loss='batch'"),
                                        (dict(balance_loss="micro_batch", router="expert_choice"),
                                         "needs token-choice")])
def test_bad_balance_arguments(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        MoELayer(D, 4, E, 2, **kwargs)


def test_model_wide_helpers():
    from moe.aux import moe_layers, reset_balance_windows, set_balance_group
    model = torch.nn.Sequential(make_layer(2, balance_loss="global_batch"),
                                make_layer(2, balance_loss="global_batch")).train()
    model(x64())
    assert all(int(m.balance.window[-1]) == G * S for _, m in moe_layers(model))
    reset_balance_windows(model)
    assert all(int(m.balance.window.sum()) == 0 for _, m in moe_layers(model))
    set_balance_group(model, None)
    assert all(m.balance.group is None for _, m in moe_layers(model))
