"""MoELayer routing options against the naive per-token reference (tests/unit/reference.py),
plus hand-checked properties of each option and the errors for combinations that cannot work.

Shapes: G routing groups, S tokens per group, D model dim, E experts, K top-k.
Tolerances as in test_layer.py (fp64: only summation order differs).
"""
import pytest
import torch

from moe import MoELayer
from moe.scoring import group_keep_mask
from tests.unit.reference import clamped_swiglu_by_hand, reference_moe
from tests.unit.test_layer import TOL, assert_same, make_layer

G, S, D, FF, E = 2, 6, 8, 12, 6
F64 = TOL[torch.float64]


def x64(seed=0, shape=(G, S, D)):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def gates_by_token(layer, x):
    """{token: {expert: gate}} from the router's assignments."""
    routing = layer.router(x, None)
    out = {}
    for t, e, g in zip(routing.token_A.tolist(), routing.expert_A.tolist(), routing.gate_A.tolist()):
        out.setdefault(t, {})[e] = g
    return out


CASES = [
    dict(score_func="sigmoid"),
    dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    dict(norm_topk_prob=False),
    dict(n_group=2, topk_group=1),
    dict(score_func="sigmoid", n_group=3, topk_group=2, routed_scaling_factor=1.5,
         norm_topk_prob=True),
    dict(router_bias=True),
    dict(num_shared_experts=1, shared_d_ff=5, shared_expert_gate=True),
    dict(activation="clamped_swiglu", expert_bias=True, swiglu_alpha=1.3, swiglu_limit=0.4),
    dict(score_func="sigmoid", cf=0.75),
    dict(expert_capacity=2),
]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_option_matches_reference(case, k):
    kw = dict(case)
    activation, cf = kw.pop("activation", "swiglu"), kw.pop("cf", None)
    layer = make_layer(k, activation, cf, torch.float64, **kw)
    with torch.no_grad():
        if layer.router.bias is not None:
            layer.router.bias.normal_(0, 1.0)
        layer.router.selection_bias.copy_(torch.linspace(-0.2, 0.3, E, dtype=torch.float64))
    assert_same(layer, x64(), F64)


def test_sigmoid_gates_are_sigmoid_scores_and_bias_only_selects():
    layer = make_layer(2, "swiglu", None, torch.float64, score_func="sigmoid", norm_topk_prob=False)
    x = x64()
    sig = torch.sigmoid(x.reshape(-1, D) @ layer.router.weight.t())
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.tensor([0.0, 0, 0, 0, 0, 5.0]))  # favour 5
    for t, gates in gates_by_token(layer, x).items():
        assert 5 in gates
        for e, g in gates.items():
            assert g == pytest.approx(float(sig[t, e].detach()), rel=1e-12)  # unbiased sigmoid
    layer.train()
    layer(x)
    layer.router.update_selection_bias(0.1)  # aux-loss-free update: expert 5 was overloaded
    assert float(layer.router.selection_bias[5]) == pytest.approx(4.9)


@pytest.mark.parametrize("k,norm,want_sum", [(1, True, 1.0), (2, True, 1.0)])
def test_norm_topk_prob_true_sums_to_one(k, norm, want_sum):
    layer = make_layer(k, norm_topk_prob=norm)
    for gates in gates_by_token(layer, x64()).values():
        assert sum(gates.values()) == pytest.approx(want_sum, rel=1e-12)


def test_norm_topk_prob_false_keeps_raw_probabilities():
    layer = make_layer(2, norm_topk_prob=False)
    x = x64()
    probs = torch.softmax(x.reshape(-1, D) @ layer.router.weight.t(), -1)
    for t, gates in gates_by_token(layer, x).items():
        top2 = probs[t].topk(2).values
        assert sorted(gates.values()) == pytest.approx(sorted(top2.tolist()), rel=1e-12)
        assert sum(gates.values()) < 1.0


def test_routed_scaling_factor_scales_gates_not_weights():
    a = make_layer(2, "swiglu", score_func="sigmoid", norm_topk_prob=True)
    b = make_layer(2, "swiglu", score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5)
    x = x64()
    for (ta, ga), (tb, gb) in zip(gates_by_token(a, x).items(), gates_by_token(b, x).items()):
        assert ga.keys() == gb.keys() and sum(gb.values()) == pytest.approx(2.5, rel=1e-12)
    torch.testing.assert_close(b.experts.w1, a.experts.w1)
    torch.testing.assert_close(b(x), 2.5 * a(x), **F64)


def test_group_limit_by_hand():
    # E=6 in 3 groups of 2. Group sums of top-2: g0 = .9+.1 = 1.0, g1 = .5+.45 = .95,
    # g2 = .8+.0 = .8 -> topk_group=2 keeps g0, g1; the best three experts there: 0, 2, 3
    choice = torch.tensor([[0.9, 0.1, 0.5, 0.45, 0.8, 0.0]])
    assert group_keep_mask(choice, 3, 2).tolist() == [[True, True, True, True, False, False]]
    layer = make_layer(3, n_group=3, topk_group=2)
    x = x64()
    probs = torch.softmax(x.reshape(-1, D) @ layer.router.weight.t(), -1)
    for t, gates in gates_by_token(layer, x).items():
        groups = {e // 2 for e in gates}
        assert len(groups) <= 2
        keep = group_keep_mask(probs[t:t + 1], 3, 2)[0]
        assert all(keep[e] for e in gates)


def test_router_bias_gets_gradient():
    layer = make_layer(2, router_bias=True)
    layer(x64()).sum().backward()
    assert layer.router.bias.shape == (E,) and layer.router.bias.grad.abs().sum() > 0


def test_clamped_swiglu_hand_numbers():
    gate = torch.tensor([-1.0, 0.5, 9.0], dtype=torch.float64)
    up = torch.tensor([-9.0, 0.25, 2.0], dtype=torch.float64)
    # limit 7: gate -> [-1, .5, 7], up -> [-7, .25, 2]; alpha 1.702
    want = [(-7 + 1) * -1 * torch.sigmoid(torch.tensor(-1.702)).item(),
            1.25 * 0.5 * torch.sigmoid(torch.tensor(0.851)).item(),
            3 * 7 * torch.sigmoid(torch.tensor(7 * 1.702)).item()]
    got = clamped_swiglu_by_hand(gate, up, 1.702, 7.0).tolist()
    assert got == pytest.approx(want, rel=1e-6)
    from moe.activations import clamped_swiglu
    assert clamped_swiglu(gate, up, 1.702, 7.0).tolist() == pytest.approx(want, rel=1e-6)


def test_shared_expert_gate_scales_shared_output():
    layer = make_layer(2, num_shared_experts=1, shared_expert_gate=True)
    plain = make_layer(2, num_shared_experts=1)
    with torch.no_grad():
        plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "shared_experts.gate"})
        layer.shared_experts.gate.zero_()  # sigmoid(0) = 1/2
    x = x64()
    routed = reference_moe(layer, x)[0] - 0.5 * plain.shared_experts(x)
    torch.testing.assert_close(layer(x), routed + 0.5 * plain.shared_experts(x), **F64)
    torch.testing.assert_close(layer(x) - plain(x), -0.5 * plain.shared_experts(x), **F64)


BAD = [
    (dict(score_func="tanh"), "score_func="),
    (dict(norm_topk_prob="yes"), "norm_topk_prob="),
    (dict(n_group=4), "n_group=4 does not divide"),
    (dict(n_group=6), "n_group=6 leaves 1"),
    (dict(n_group=3, topk_group=4), "topk_group=4"),
    (dict(n_group=3, topk_group=1, top_k=3), "top_k=3 is more than"),
    (dict(router="expert_choice", n_group=3, topk_group=1), "n_group=3 limits"),
    (dict(router="expert_choice", norm_topk_prob=True), "norm_topk_prob=True"),
    (dict(routed_scaling_factor=0), "routed_scaling_factor="),
    (dict(shared_expert_gate=True), "shared_expert_gate=True needs"),
    (dict(expert_capacity=0), "expert_capacity="),
    (dict(expert_capacity=2, capacity_factor=1.0), "expert_capacity=2 and capacity_factor"),
    (dict(activation="clamped_swiglu", swiglu_limit=0), "swiglu_limit="),
    (dict(logits_dtype="int8"), "logits_dtype="),
]


@pytest.mark.parametrize("kwargs,msg", BAD)
def test_impossible_combinations_are_named(kwargs, msg):
    args = dict(d_model=D, d_ff=FF, num_experts=E, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        MoELayer(**args)


def test_fp32_scores_in_fp64_run():
    """score_dtype='float32': fp64 logits, scores rounded to fp32 (HF Mixtral/Qwen in fp64)."""
    layer = make_layer(2, score_dtype="float32")
    x = x64()
    routing = layer.router(x, None)
    assert routing.gate_A.dtype == torch.float32
    probs32 = torch.softmax((x.reshape(-1, D) @ layer.router.weight.t()).float(), -1)
    top2 = probs32.topk(2, -1).values
    want = (top2 / top2.sum(-1, keepdim=True)).reshape(-1)
    assert torch.equal(routing.gate_A.detach(), want)  # the same fp32 ops, bit for bit
    exact = make_layer(2)
    assert layer(x).dtype == torch.float64
    torch.testing.assert_close(layer(x), exact(x), rtol=1e-5, atol=1e-7)
    assert not torch.equal(layer(x), exact(x))


def test_moe_config_fields_reach_the_layer():
    from models.config import ModelConfig, MoEConfig
    from models.layers import make_ffn
    model_cfg = ModelConfig(d_model=D, d_ff=FF, activation="clamped_swiglu").validate()
    moe_cfg = MoEConfig(num_experts=E, top_k=2, every=1, score_func="sigmoid", norm_topk_prob=True,
                        n_group=3, topk_group=2, routed_scaling_factor=2.5, router_bias=True,
                        num_shared_experts=1, shared_expert_gate=True, swiglu_alpha=1.5,
                        swiglu_limit=3.0, balance_loss="global_batch").validate(model_cfg)
    layer = make_ffn(model_cfg, moe_cfg, 0, 0.02, False)
    r = layer.router.config
    assert (r.score_func, r.norm_topk_prob, r.n_group, r.topk_group) == ("sigmoid", True, 3, 2)
    assert r.routed_scaling_factor == 2.5 and layer.router.bias is not None
    assert layer.shared_experts.gate is not None
    assert (layer.experts.act.alpha, layer.experts.act.limit) == (1.5, 3.0)
    assert layer.balance_loss == "global_batch"
    default = make_ffn(model_cfg, MoEConfig(num_experts=E, every=1).validate(), 0, 0.02, False)
    assert (default.router.config.score_func, default.router.config.norm_topk_prob,
            default.router.config.n_group) == (
        "softmax", True, 1)
    assert default.router.bias is None and default.shared_experts is None


@pytest.mark.parametrize("kwargs,msg", [
    (dict(score_func="relu"), "moe.score_func"), (dict(n_group=4), "moe.n_group=4"),
    (dict(n_group=2, topk_group=3), "moe.topk_group=3"),
    (dict(routed_scaling_factor=0.0), "moe.routed_scaling_factor"),
    (dict(norm_topk_prob="maybe"), "moe.norm_topk_prob"),
    (dict(balance_loss="step"), "moe.balance_loss"),
    (dict(balance_loss="micro_batch", router="expert_choice"), "moe.balance_loss")])
def test_moe_config_validation_names_the_field(kwargs, msg):
    from models.config import MoEConfig
    with pytest.raises(ValueError, match=msg):
        MoEConfig(num_experts=E, top_k=2, every=1, **kwargs).validate()
