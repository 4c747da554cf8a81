"""experts_impl: the grouped-GEMM path equals the loop path and the naive reference.

Shapes: G routing groups, S tokens per group, D model dim, FF ffn dim, E experts, K top-k.
Tolerances: fp32 rtol 1e-5 / atol 1e-5 on values of order 1e-2..1 (same products, different
summation blocking); bf16 (experts in bf16, router fp32): max error <= 3% of the fp32
result's max magnitude, as in test_layer.py. FF=16 so bf16 rows are 32 bytes: grouped_mm
needs 16-byte strides.
"""
import pytest
import torch

from moe import ExpertBank, MoELayer
from moe.grouped_mm import unsupported_reason
from tests.unit.reference import reference_moe

G, S, D, FF, E = 2, 6, 8, 16, 6
TOL32 = dict(rtol=1e-5, atol=1e-5)
IMPLS = ("loop", "grouped_mm")
REFERENCE_ACTS = ("gelu", "relu", "swiglu", "clamped_swiglu")  # what tests/unit/reference.py knows


def make_layer(impl, k=2, activation="gelu", cf=None, bias=False, seed=0, **kw):
    torch.manual_seed(seed)
    layer = MoELayer(D, FF, E, k, cf, activation, expert_bias=bias, aux_loss_coef=0.1,
                     z_loss_coef=0.01, experts_impl=impl, **kw)
    with torch.no_grad():  # decisive routing and O(1) activations (clamped_swiglu clamps some)
        layer.router.weight.normal_(0, 1.0)
        for p in layer.experts.parameters():
            p.normal_(0, 0.6)
    return layer


def run(layer, x, gy, fn):
    """y and every gradient (input, router, experts) of <y, gy> + aux_loss."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y, aux = fn(layer, x)
    ((y.float() * gy).sum() + aux).backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return y.detach(), grads


def ours(layer, x):
    return layer(x), layer.aux_loss


def naive(layer, x):
    y, _, _, aux = reference_moe(layer, x)
    return y, aux


def assert_all_close(a, b, tol, what):
    ya, ga = a
    yb, gb = b
    torch.testing.assert_close(ya, yb, **tol, msg=lambda m: f"{what} output: {m}")
    assert ga.keys() == gb.keys()
    for n in ga:
        assert ga[n] is not None and gb[n] is not None, f"{what}: no grad for {n}"
        torch.testing.assert_close(ga[n], gb[n], **tol, msg=lambda m: f"{what} grad {n}: {m}")


@pytest.mark.parametrize("activation", ["gelu", "relu", "gelu_tanh", "silu", "swiglu", "geglu",
                                        "clamped_swiglu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,cf", [(1, None), (2, None), (2, 0.75)])
def test_grouped_mm_equals_loop_and_reference_fp32(activation, bias, k, cf):
    x = torch.randn(G, S, D)
    gy = torch.randn(G, S, D)
    kw = dict(swiglu_limit=1.0) if activation == "clamped_swiglu" else {}  # so it clamps
    loop = make_layer("loop", k, activation, cf, bias, **kw)
    grouped = make_layer("grouped_mm", k, activation, cf, bias, **kw)
    assert grouped.experts.impl_for(x.reshape(-1, D)) == "grouped_mm"
    got = run(grouped, x, gy, ours)
    assert_all_close(got, run(loop, x, gy, ours), TOL32, "grouped_mm vs loop")
    if activation in REFERENCE_ACTS:
        assert_all_close(got, run(grouped, x, gy, naive), TOL32, "grouped_mm vs reference")
    if activation == "clamped_swiglu":  # the clamp really cut some pre-activations
        h = x.reshape(-1, D) @ grouped.experts.w1[0]
        assert (h > grouped.experts.act.limit).any()


@pytest.mark.lowp
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_mm_bf16_matches_loop_and_fp32(activation):
    x = torch.randn(G, 16, D)
    gy = torch.randn(G, 16, D)
    for impl in IMPLS:
        layer = make_layer(impl, 2, activation).to(torch.bfloat16)
        y, g = run(layer, x.bfloat16(), gy, ours)
        assert y.dtype == torch.bfloat16 and g["experts.w1"].dtype == torch.bfloat16
        # same (bf16-rounded) weights in fp32 as the comparison point
        layer32 = make_layer("loop", 2, activation)
        layer32.load_state_dict({n: t.float() for n, t in layer.state_dict().items()})
        y32, g32 = run(layer32, x.bfloat16().float(), gy, ours)
        for name, a, b in [("y", y, y32)] + [(n, g[n], g32[n]) for n in g]:
            err = (a.float() - b).abs().max()
            assert err <= 0.03 * b.abs().max(), f"{impl} {name}: bf16 error {err}"


@pytest.mark.parametrize("activation,bias", [("gelu", False), ("swiglu", True),
                                             ("clamped_swiglu", True)])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [0, 9, 0, 0], [600, 0, 3, 1]])
def test_bank_grouped_mm_with_idle_experts_equals_plain_ops(activation, bias, counts):
    """Counts as a device tensor (the no-host-sync form) and as ints; idle experts get
    exactly zero gradients."""
    torch.manual_seed(2)
    bank = ExpertBank(4, D, FF, activation, bias=bias, experts_impl="grouped_mm")
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(sum(counts), D)
    gy = torch.randn(sum(counts), D)
    results = []
    for fn, c in ((bank.forward, torch.tensor(counts)), (bank.forward, counts),
                  (bank._forward_ops, counts)):
        bank.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        (fn(xi, c) * gy).sum().backward()
        results.append([xi.grad] + [p.grad for p in bank.parameters()])
    for res in results[:2]:
        assert all(g is not None for g in res[1:])
        for p in res[1:]:
            for e, n in enumerate(counts):
                if n == 0:
                    assert not p[e].any(), "an idle expert's gradient must be exactly zero"
        for a, b in zip(res, results[2]):
            if b is None:  # plain ops give no x grad only when there are no rows
                assert a is None or not a.any()
                continue
            torch.testing.assert_close(a, b, **TOL32)


def test_all_tokens_on_one_expert_leaves_the_rest_idle():
    x, gy = torch.randn(G, S, D), torch.randn(G, S, D)
    results = []
    for impl in IMPLS:
        layer = make_layer(impl, 1, "swiglu", bias=True)
        with torch.no_grad():
            layer.router.selection_bias[3] = 100.0
        results.append(run(layer, x, gy, ours))
        assert layer.last_stats.kept_E.tolist() == [0, 0, 0, G * S, 0, 0]
    assert_all_close(results[1], results[0], TOL32, "one busy expert")
    assert not results[1][1]["experts.w2"][[0, 1, 2, 4, 5]].any()


def test_experts_get_device_counts_from_the_dispatcher():
    """The one-process dispatcher hands every path its counts as a long tensor (no .tolist()
    host sync on the way); only the loop path turns them into ints, inside the experts."""
    seen = {}
    for impl in IMPLS:
        layer = make_layer(impl)
        layer.experts.register_forward_pre_hook(lambda m, args, impl=impl: seen.update({impl: args[1]}))
        layer(torch.randn(G, S, D))
    for impl in IMPLS:
        assert isinstance(seen[impl], torch.Tensor) and seen[impl].dtype == torch.long, impl
        assert int(seen[impl].sum()) == G * S * 2


def test_auto_falls_back_and_explicit_grouped_mm_names_the_fix():
    x = torch.randn(G, S, D, dtype=torch.float64)
    assert make_layer("auto").double().experts.impl_for(x.reshape(-1, D)) == "loop"
    with pytest.raises(ValueError, match=r"experts_impl='grouped_mm'.*float64.*'loop'"):
        make_layer("grouped_mm").double()(x)
    odd = MoELayer(D, 12, E, 2, experts_impl="grouped_mm").to(torch.bfloat16)  # 24-byte rows
    with pytest.raises(ValueError, match=r"d_ff=12 \(24 bytes\).*16"):
        odd(torch.randn(S, D, dtype=torch.bfloat16))
    assert unsupported_reason(torch.device("cpu"), torch.float32, 8, 12) is None
    with pytest.raises(ValueError, match=r"experts_impl='fast'.*'grouped_mm'"):
        MoELayer(D, FF, E, 2, experts_impl="fast")
    assert "experts_impl='grouped_mm'" in repr(make_layer("grouped_mm"))
