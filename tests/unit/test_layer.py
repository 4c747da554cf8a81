"""MoELayer against the naive per-token reference: outputs, every gradient, drops, dtypes.

Shapes: G routing groups (sequences), S tokens per group, D model dim, E experts, K top-k.
Tolerances: fp64 rtol 1e-9 / atol 1e-11 (only summation order differs); fp32 rtol 2e-4 /
atol 2e-6 on values of order 1e-2..1 (fp32 eps 1.2e-7 times sums of a few hundred terms);
bf16 (experts in bf16, router fp32): max error <= 3% of the output's max magnitude.
"""
import copy

import pytest
import torch

from moe import MoELayer
from tests.unit.reference import reference_moe

G, S, D, FF, E = 2, 6, 8, 12, 6
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=2e-6)}


def make_layer(k=2, activation="gelu", cf=None, dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    layer = MoELayer(D, FF, E, k, cf, activation, aux_loss_coef=0.1, z_loss_coef=0.01, **kw)
    with torch.no_grad():  # decisive routing (no near-ties) and O(1) activations
        layer.router.weight.normal_(0, 1.0)
        for p in layer.experts.parameters():
            p.normal_(0, 0.3)
        if layer.shared_experts is not None:
            for p in layer.shared_experts.parameters():
                p.normal_(0, 0.3)
    return layer.to(dtype)


def named_grads(layer, x):
    out = {"x": x.grad}
    out.update({n: p.grad for n, p in layer.named_parameters()})
    return out


def run_with_grads(layer, x, gy, fn):
    """fn(layer, x) -> (y, aux_loss); backward of <y, gy> + aux_loss; returns y and grads."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y, aux = fn(layer, x)
    ((y * gy).sum() + aux).backward()
    return y.detach(), named_grads(layer, x)


def ours(layer, x):
    y = layer(x)
    return y, layer.aux_loss


def ref(layer, x):
    y, _, _, aux = reference_moe(layer, x)
    return y, aux


def assert_same(layer, x, tol):
    gy = torch.randn_like(x)
    y1, g1 = run_with_grads(layer, x, gy, ours)
    y2, g2 = run_with_grads(layer, x, gy, ref)
    torch.testing.assert_close(y1, y2, **tol)
    assert g1.keys() == g2.keys()
    for name in g1:
        assert g1[name] is not None and g2[name] is not None, name
        torch.testing.assert_close(g1[name], g2[name], **tol, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("cf", [None, 0.75])
def test_matches_reference(k, activation, cf, dtype):
    layer = make_layer(k, activation, cf, dtype)
    x = torch.randn(G, S, D, dtype=dtype)
    assert_same(layer, x, TOL[dtype])
    if cf is not None:  # the capacity case really dropped something, exactly what the spec drops
        _, _, kept, _ = reference_moe(layer, x)
        assert len(kept) < G * S * k
        assert int(layer.last_stats.kept_E.sum()) == len(kept)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_dropped_assignments_are_the_specified_ones(k):
    layer = make_layer(k, cf=0.5)
    x = torch.randn(G, S, D, dtype=torch.float64)
    routing = layer.router(x, 0.5)
    got = {(int(s), int(e)) for s, e in zip(routing.slot_A, routing.expert_A) if e < E}
    dropped_A = routing.expert_A == E
    assert dropped_A.any() and (routing.gate_A[dropped_A] == 0).all()  # gate 0 where dropped
    _, _, kept, _ = reference_moe(layer, x)
    want = {((g * S + s) * k + kk, e) for g, s, kk, e, _ in kept}
    assert got == want


def test_bias_shared_experts_and_relu_match_reference():
    layer = make_layer(2, "relu", None, torch.float64, expert_bias=True, num_shared_experts=2,
                       shared_d_ff=5)
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.linspace(-0.3, 0.3, E, dtype=torch.float64))
    assert_same(layer, torch.randn(G, S, D, dtype=torch.float64), TOL[torch.float64])


@pytest.mark.parametrize("k", [1, 2])
def test_expert_choice_matches_reference(k):
    layer = make_layer(k, "swiglu", 1.5, torch.float64, router="expert_choice")
    assert_same(layer, torch.randn(G, S, D, dtype=torch.float64), TOL[torch.float64])


def test_input_shapes_define_routing_groups():
    layer = make_layer(2, cf=0.5)
    x = torch.randn(3, 2, S, D, dtype=torch.float64)  # groups are the last-but-one dim
    assert_same(layer, x, TOL[torch.float64])
    assert_same(layer, torch.randn(S, D, dtype=torch.float64), TOL[torch.float64])
    assert layer(torch.randn(D, dtype=torch.float64)).shape == (D,)


@pytest.mark.parametrize("activation,dense_act", [("gelu", torch.nn.GELU()), ("relu", torch.nn.ReLU())])
def test_one_expert_top1_equals_dense_ffn(activation, dense_act):
    torch.manual_seed(1)
    dense = torch.nn.Sequential(torch.nn.Linear(D, FF, bias=False), dense_act,
                                torch.nn.Linear(FF, D, bias=False)).double()
    layer = MoELayer(D, FF, 1, 1, None, activation).double()
    with torch.no_grad():
        layer.experts.w1[0].copy_(dense[0].weight.t())
        layer.experts.w2[0].copy_(dense[2].weight.t())
    x = torch.randn(4, 5, D, dtype=torch.float64)
    gy = torch.randn_like(x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), dense(xb)
    (ya * gy).sum().backward()
    (yb * gy).sum().backward()
    tol = TOL[torch.float64]
    torch.testing.assert_close(ya, yb, **tol)
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    torch.testing.assert_close(layer.experts.w1.grad[0], dense[0].weight.grad.t(), **tol)
    torch.testing.assert_close(layer.experts.w2.grad[0], dense[2].weight.grad.t(), **tol)


@pytest.mark.parametrize("router", ["token_choice", "expert_choice"])
def test_deterministic_bit_identical(router):
    layer = make_layer(2, "swiglu", 1.0, torch.float32, router=router)
    x = torch.randn(4, 16, D)
    gy = torch.randn_like(x)
    y1, g1 = run_with_grads(layer, x, gy, ours)
    y2, g2 = run_with_grads(layer, x, gy, ours)
    assert torch.equal(y1, y2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


@pytest.mark.lowp
def test_bf16_path_close_to_fp32():
    layer16 = make_layer(2, "swiglu", None, torch.float32).to(torch.bfloat16)
    layer32 = copy.deepcopy(layer16).float()  # same (bf16-rounded) weights, computed in fp32
    x16 = torch.randn(G, 16, D).to(torch.bfloat16)
    routing = layer16.router(x16, None)
    assert routing.gate_A.dtype == torch.float32  # router runs in fp32 on bf16 inputs
    gy = torch.randn(G, 16, D)
    y16, g16 = run_with_grads(layer16, x16, gy.bfloat16(), ours)
    y32, g32 = run_with_grads(layer32, x16.float(), gy, ours)
    assert y16.dtype == torch.bfloat16 and g16["experts.w1"].dtype == torch.bfloat16
    assert g16["x"].dtype == torch.bfloat16
    for name, a, b in [("y", y16, y32)] + [(n, g16[n], g32[n]) for n in g16]:
        err = (a.float() - b).abs().max()
        assert err <= 0.03 * b.abs().max(), f"{name}: bf16 error {err} vs scale {b.abs().max()}"


def test_eval_capacity_factor():
    layer = make_layer(2, cf=0.5, eval_capacity_factor=None)
    x = torch.randn(G, S, D, dtype=torch.float64)
    layer.train()
    layer(x)
    assert layer.last_stats.dropped_fraction > 0
    layer.eval()
    y = layer(x)
    assert layer.last_stats.dropped_fraction == 0
    torch.testing.assert_close(y, reference_moe(layer, x, None)[0], **TOL[torch.float64])
    layer = make_layer(2, cf=4.0, eval_capacity_factor=0.5).eval()
    torch.testing.assert_close(layer(x), reference_moe(layer, x, 0.5)[0], **TOL[torch.float64])
    assert layer.last_stats.dropped_fraction > 0


def test_stats():
    layer = make_layer(2, cf=0.5)
    x = torch.randn(G, S, D, dtype=torch.float64)
    with torch.no_grad():
        layer.router.selection_bias[0] = -10.0  # expert 0 is never selected
        layer(x)
    st = layer.last_stats
    _, _, kept, _ = reference_moe(layer, x)
    T, K = G * S, 2
    assert int(st.routed_E.sum()) == T * K
    assert int(st.kept_E.sum()) == len(kept) == T * K - round(st.dropped_fraction * T * K)
    want_E = torch.bincount(torch.tensor([e for *_, e, _ in kept]), minlength=E)
    assert torch.equal(st.kept_E.cpu(), want_E)
    assert st.dead_experts == [0]
    assert st.imbalance == pytest.approx(float(want_E.max()) / (len(kept) / E))
    probs = torch.softmax(x.reshape(T, D) @ layer.router.weight.t(), -1)
    entropy = -(probs * probs.log()).sum(-1).mean().detach()
    assert float(st.entropy) == pytest.approx(float(entropy), rel=1e-5)
    d = st.as_dict()
    assert d["counts"] == want_E.tolist() and d["tokens"] == T


BAD_ARGS = [
    (dict(num_experts=0), "num_experts"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=5, num_experts=4), "top_k"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(eval_capacity_factor=0), "eval_capacity_factor"),
    (dict(activation="tanh"), "activation"),
    (dict(router="hash"), "router"),
    (dict(d_model=0), "d_model"),
    (dict(top_k=True), "top_k"),
]


@pytest.mark.parametrize("kwargs,name", BAD_ARGS)
def test_bad_constructor_args_name_the_argument(kwargs, name):
    args = dict(d_model=D, d_ff=FF, num_experts=E, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"\b{name}="):
        MoELayer(**args)


def test_bad_inputs_name_the_problem():
    layer = make_layer(2)
    with pytest.raises(ValueError, match=rf"d_model={D}"):
        layer(torch.randn(3, D + 1, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating"):
        layer(torch.ones(3, D, dtype=torch.long))


@pytest.mark.parametrize("activation,bias", [("gelu", False), ("swiglu", True), ("relu", True),
                                             ("gelu_tanh", False)])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 9, 0, 0], [600, 0, 3, 1]])
def test_fused_expert_bank_equals_plain_ops(activation, bias, counts):
    """The fused grouped-FFN node against the bank's plain-op path, idle experts included
    (600 rows: the row-major hidden layout; fewer: column-major on CPU)."""
    from moe import ExpertBank
    torch.manual_seed(2)
    bank = ExpertBank(4, D, FF, activation, bias=bias).double()
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(sum(counts), D, dtype=torch.float64)
    gy = torch.randn(sum(counts), D, dtype=torch.float64)
    results = []
    for fn in (bank.forward, bank._forward_ops):
        bank.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = fn(xi, counts)
        (y * gy).sum().backward()
        results.append([y, xi.grad] + [p.grad for p in bank.parameters()])
    assert all(g is not None for g in results[0])  # idle experts still get (zero) gradients
    for a, b in zip(*results):
        if b is None:  # the plain path leaves no x grad only when there are no rows
            assert a is None or a.numel() == 0 or not a.any()
            continue
        torch.testing.assert_close(a, b, **TOL[torch.float64])


@pytest.mark.lowp
def test_fused_expert_bank_under_autocast_matches_plain_ops():
    """bf16 autocast over fp32 weights: the fused path casts once and equals the op path."""
    from moe import ExpertBank
    torch.manual_seed(4)
    bank = ExpertBank(3, D, FF, "swiglu")
    x = torch.randn(10, D)
    counts = [4, 0, 6]
    results = []
    for fn in (bank.forward, bank._forward_ops):
        bank.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xi, counts)
        y.float().sum().backward()
        assert y.dtype == torch.bfloat16 and bank.w1.grad.dtype == torch.float32
        results.append([y.float(), xi.grad] + [p.grad for p in bank.parameters()])
    for a, b in zip(*results):  # same bf16 ops in the same order: equal up to bf16 rounding
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
