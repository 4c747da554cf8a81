"""The router's fused ops (moe/router_ops.py) against the plain ops they stand for: values
and gradients, on the CPU bit for bit (they run the same arithmetic there), and float64
gradcheck of the hand-written backward."""
import pytest
import torch

from moe.losses import router_z_loss
from moe.router_ops import mean_entropy, router_logits, score_stats
from moe.scoring import balance_probs, scores_from_logits


def _plain_stats(logits, score_func):
    scores = scores_from_logits(logits, score_func)
    return scores, router_z_loss(logits), mean_entropy(balance_probs(scores, score_func))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_score_stats_equals_the_plain_ops(score_func):
    torch.manual_seed(0)
    logits = torch.randn(2, 64, 8) * 3
    g_scores = torch.randn(2, 64, 8)
    got, want = [], []
    for fn, out in ((score_stats, got), (_plain_stats, want)):
        leaf = logits.clone().requires_grad_(True)
        scores, z, ent = fn(leaf, score_func)
        ((scores * g_scores).sum() + 0.3 * z).backward()
        out += [scores.detach(), z.detach(), ent, leaf.grad]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2]) and not got[2].requires_grad
    # the backward is hand-written (two terms summed in another order): fp32 rounding apart
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("which", ["scores", "z_loss", "both"])
def test_score_stats_gradcheck(score_func, which):
    torch.manual_seed(1)
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, dtype=torch.float64)

    def f(x):
        scores, z, _ = score_stats(x, score_func)
        parts = {"scores": (scores * w).sum(), "z_loss": z}
        return sum(parts.values()) if which == "both" else parts[which]
    assert torch.autograd.gradcheck(f, (logits,))


def test_router_logits_equals_the_widened_gemm_on_cpu():
    torch.manual_seed(2)
    x = torch.randn(96, 32, dtype=torch.bfloat16)
    w = torch.randn(8, 32, dtype=torch.bfloat16) * 0.1
    g = torch.randn(96, 8)
    grads = []
    for fused in (True, False):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = router_logits(xl, wl) if fused else xl.float() @ wl.float().t()
        assert out.dtype == torch.float32
        out.backward(g)
        grads.append((out.detach(), xl.grad, wl.grad))
    for a, b in zip(*grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_router_uses_the_fused_ops_for_a_bf16_input():
    """A bf16 layer's router makes no fp32 copy of its input: the census sees router_logits
    and score_stats, and no [T, D] _to_copy."""
    from moe.config import RoutingConfig
    from moe.profiling.census import OpCensus
    from moe.router import Router
    r = Router(32, RoutingConfig(num_experts=8, top_k=2)).to(torch.bfloat16)
    x = torch.randn(1, 64, 32, dtype=torch.bfloat16)
    with OpCensus() as census:
        routing = r(x, None)
    assert census.by_op["router_logits"] == 1 and census.by_op["score_stats"] == 1
    assert census.by_op["_to_copy"] == 0
    assert routing.z_loss.dtype == torch.float32 and routing.gate_A.dtype == torch.float32
