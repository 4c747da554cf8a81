"""Aux losses against hand-computed numbers, and their gradients.

Shapes: G routing groups, S tokens per group, E experts, K top-k.
Load balance (Switch): E * sum_e f_e * P_e per group, f_e = share of the group's S*K
assignments choosing e, P_e = mean router probability of e; averaged over groups.
z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.
"""
import math

import pytest
import torch

from moe import MoELayer
from moe.losses import load_balance_loss, router_z_loss


def test_load_balance_hand_numbers():
    # k=1, E=2: both tokens pick expert 0 -> f = [1, 0], P = [0.75, 0.25] -> 2 * 0.75 = 1.5
    probs = torch.tensor([[[0.7, 0.3], [0.8, 0.2]]])
    assert float(load_balance_loss(probs, torch.tensor([[[0], [0]]]))) == pytest.approx(1.5)
    # k=2, E=3: picks {0,1} and {1,2} -> f = [.25, .5, .25], P = [.3, .45, .25]
    # 3 * (.075 + .225 + .0625) = 1.0875
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]])
    ids = torch.tensor([[[0, 1], [1, 2]]])
    assert float(load_balance_loss(probs, ids)) == pytest.approx(1.0875)
    # two groups are averaged: 1.5 and 2 * 0.65 = 1.3 -> 1.4
    probs = torch.tensor([[[0.7, 0.3], [0.8, 0.2]], [[0.3, 0.7], [0.4, 0.6]]])
    ids = torch.tensor([[[0], [0]], [[1], [1]]])
    assert float(load_balance_loss(probs, ids)) == pytest.approx(1.4)


def test_uniform_routing_gives_one():
    probs = torch.full((1, 4, 4), 0.25)
    ids = torch.tensor([[[0], [1], [2], [3]]])
    assert float(load_balance_loss(probs, ids)) == pytest.approx(1.0)


def test_z_loss_hand_numbers():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    want = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert float(router_z_loss(logits)) == pytest.approx(want)


def tiny_layer(cf=None):
    layer = MoELayer(2, 3, 2, 1, cf, "gelu", aux_loss_coef=0.1, z_loss_coef=0.01).double()
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))  # logits = x
    return layer


def test_layer_aux_loss_value():
    layer = tiny_layer()
    # logits [ln3, 0] and [ln4, 0]: probs [.75, .25], [.8, .2]; both pick expert 0
    x = torch.tensor([[math.log(3.0), 0.0], [math.log(4.0), 0.0]], dtype=torch.float64)
    layer(x)
    lb = 2 * 0.775
    z = (math.log(4) ** 2 + math.log(5) ** 2) / 2
    assert float(layer.aux_losses["load_balance"].detach()) == pytest.approx(lb)
    assert float(layer.aux_losses["z_loss"].detach()) == pytest.approx(z)
    assert float(layer.aux_loss.detach()) == pytest.approx(0.1 * lb + 0.01 * z)


def test_load_balance_counts_choices_before_capacity_drops():
    x = torch.tensor([[math.log(3.0), 0.0], [math.log(4.0), 0.0]], dtype=torch.float64)
    layer = tiny_layer(cf=0.5)  # capacity 1: the second token's choice is dropped
    layer(x)
    assert layer.last_stats.dropped_fraction == 0.5
    assert float(layer.aux_losses["load_balance"].detach()) == pytest.approx(2 * 0.775)


def test_aux_loss_gradient_reaches_router_and_matches_formula():
    torch.manual_seed(0)
    layer = MoELayer(4, 6, 3, 2, None, "gelu", aux_loss_coef=0.3, z_loss_coef=0.05).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    layer(x)
    layer.aux_loss.backward()
    got = layer.router.weight.grad.clone()
    assert got.abs().sum() > 0
    assert layer.experts.w1.grad is None  # aux losses depend on the router only

    w = layer.router.weight.detach().clone().requires_grad_(True)
    logits = x @ w.t()
    probs = torch.softmax(logits, -1)
    ids = probs.topk(2, dim=-1).indices
    f = torch.zeros(2, 3, dtype=torch.float64).scatter_add_(
        1, ids.reshape(2, -1), torch.ones(2, 10, dtype=torch.float64)) / 10
    lb = (3 * (f * probs.mean(1)).sum(-1)).mean()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    (0.3 * lb + 0.05 * z).backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-10, atol=1e-12)
