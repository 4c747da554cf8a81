"""force_balance (benchmarking): exactly balanced counts, the router's gates, live gradients.

Shapes: G routing groups, S tokens per group, D model dim, FF ffn dim, E experts, K top-k.
"""
import warnings

import pytest
import torch

from models.config import MoEConfig
from moe import MoELayer
from moe.layer import FORCE_BALANCE_WARNING

G, S, D, FF, E = 3, 8, 8, 16, 4


def make(force_balance, k=2, **kw):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = MoELayer(D, FF, E, k, force_balance=force_balance, **kw)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
        layer.router.selection_bias[0] = 100.0  # the router alone would send every token to 0
    return layer


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_counts_exactly_balanced_gates_kept_gradients_flow(k, impl):
    x = torch.randn(G, S, D, requires_grad=True)
    free, forced = make(False, k), make(True, k, experts_impl=impl)
    r_free, r_forced = free.router(x, None), forced.router(x, None)
    assert r_free.kept_E[0] == G * S  # the unforced router is maximally unbalanced
    assert r_forced.kept_E.tolist() == [G * S * k // E] * E
    torch.testing.assert_close(r_forced.gate_A, r_free.gate_A, rtol=0, atol=0)
    ids_TK = r_forced.expert_A.view(G * S, k)
    assert all(len(set(row)) == k for row in ids_TK.tolist())  # a token's experts are distinct
    y = forced(x)
    assert forced.last_stats.kept_E.tolist() == [G * S * k // E] * E
    (y ** 2).sum().backward()
    for name, p in [("x", x)] + list(forced.named_parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_capacity_drops_nothing_when_forced_balanced():
    layer = make(True, 2, capacity_factor=1.0)
    layer(torch.randn(G, S, D))
    assert layer.last_stats.dropped_fraction == 0
    assert layer.last_stats.kept_E.tolist() == [G * S * 2 // E] * E


def test_warns_and_is_visible():
    with pytest.warns(UserWarning, match="force_balance=True.*benchmarking only"):
        layer = MoELayer(D, FF, E, 2, force_balance=True)
    assert "\n" not in FORCE_BALANCE_WARNING
    assert layer.force_balance is True
    assert "force_balance=True" in repr(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when off
        plain = MoELayer(D, FF, E, 2)
    assert plain.force_balance is False and "force_balance" not in repr(plain)
    with pytest.raises(ValueError, match="force_balance=True.*router='token_choice'"):
        MoELayer(D, FF, E, 2, 1.0, router="expert_choice", force_balance=True)
    with pytest.raises(ValueError, match="force_balance='yes'"):
        MoELayer(D, FF, E, 2, force_balance="yes")


def test_config_reaches_the_layer():
    from models.config import ModelConfig
    from models.layers import make_ffn
    m = ModelConfig().validate()
    cfg = MoEConfig(force_balance=True, experts_impl="loop", every=1).validate(m)
    with pytest.warns(UserWarning, match="force_balance"):
        layer = make_ffn(m, cfg, 0, 0.02, False)
    assert layer.force_balance and layer.experts.experts_impl == "loop"
