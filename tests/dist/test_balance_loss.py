"""Every balance-loss variant is the same function under data parallelism (gloo, world 2).

One process routes the whole global batch; two ranks each route half of every micro-batch
with `set_balance_group(WORLD)`, with and without gradient accumulation over 2 micro-batches
(the one-process run accumulates over the same global micro-batches). Some tokens are masked
as padding (whole padded sequences included). Checked: the loss (mean over ranks, the
data-parallel convention) and the router gradient (mean over ranks, what DP all-reduces).
fp64, tolerance 1e-12 relative: only summation order differs.
"""
import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_distributed

B, S, D, FF, E, K = 4, 5, 8, 12, 6, 2
TOL = dict(rtol=1e-12, atol=1e-14)


def _layer(variant, score_func):
    from moe import MoELayer
    torch.manual_seed(0)
    layer = MoELayer(D, FF, E, K, balance_loss=variant, score_func=score_func).double().train()
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
    return layer


def _batches(accum):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(B, S, D, dtype=torch.float64, generator=g) for _ in range(accum)]
    masks = []
    for m in range(accum):
        mask = torch.rand(B, S, generator=g) > 0.3
        mask[m % B] = False  # one whole padded sequence per micro-batch
        masks.append(mask)
    return xs, masks


def _run(layer, xs, masks, rows):
    """Accumulate over the micro-batches like a trainer: loss / accum, backward each."""
    layer.reset_balance_window()
    layer.zero_grad(set_to_none=True)
    total = 0.0
    for x, mask in zip(xs, masks):
        layer(x[rows], token_mask=mask[rows])
        loss = layer.aux_losses["load_balance"] / len(xs)
        loss.backward()
        total += float(loss.detach())
    return torch.tensor(total, dtype=torch.float64), layer.router.weight.grad.clone()


def _worker(rank, world, variant, score_func, accum):
    xs, masks = _batches(accum)
    ref_loss, ref_grad = _run(_layer(variant, score_func), xs, masks, slice(None))
    layer = _layer(variant, score_func)
    layer.set_balance_group(dist.group.WORLD)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    loss, grad = _run(layer, xs, masks, rows)
    for t in (loss, grad):
        dist.all_reduce(t)
        t /= world
    torch.testing.assert_close(loss, ref_loss, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
    return float(loss), float(ref_loss)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("variant,score_func", [("sequence", "softmax"), ("sequence", "sigmoid"),
                                                ("micro_batch", "softmax"),
                                                ("global_batch", "softmax"),
                                                ("global_batch", "sigmoid")])
def test_balance_loss_dp2_equals_one_process(variant, score_func, accum):
    out = run_distributed(_worker, 2, variant, score_func, accum, timeout=60)
    assert out[0] == out[1] and out[0][0] > 0


def _no_group_worker(rank, world):
    """Negative control: without the group, micro_batch per rank is a different function."""
    xs, masks = _batches(1)
    ref_loss, _ = _run(_layer("micro_batch", "softmax"), xs, masks, slice(None))
    loss, _ = _run(_layer("micro_batch", "softmax"), xs, masks,
                   slice(rank * B // world, (rank + 1) * B // world))
    dist.all_reduce(loss)
    return float(loss / world), float(ref_loss)


def test_without_balance_group_the_layout_shows():
    (mean, ref), _ = run_distributed(_no_group_worker, 2, timeout=60)
    assert abs(mean - ref) > 1e-6
