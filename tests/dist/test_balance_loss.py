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


CASES = [(variant, score_func, accum) for accum in (1, 2)
         for variant, score_func in (("sequence", "softmax"), ("sequence", "sigmoid"),
                                     ("micro_batch", "softmax"), ("global_batch", "softmax"),
                                     ("global_batch", "sigmoid"))]


def _case(rank, world, variant, score_func, accum):
    """(mean over ranks of the loss, one-process loss, failure text or None)."""
    xs, masks = _batches(accum)
    ref_loss, ref_grad = _run(_layer(variant, score_func), xs, masks, slice(None))
    layer = _layer(variant, score_func)
    layer.set_balance_group(dist.group.WORLD)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    loss, grad = _run(layer, xs, masks, rows)
    for t in (loss, grad):
        dist.all_reduce(t)
        t /= world
    try:
        torch.testing.assert_close(loss, ref_loss, **TOL)
        torch.testing.assert_close(grad, ref_grad, **TOL)
        failure = None
    except AssertionError as e:
        failure = str(e)
    return float(loss), float(ref_loss), failure


def _no_group(rank, world):
    """Negative control: without the group, micro_batch per rank is a different function."""
    xs, masks = _batches(1)
    ref_loss, _ = _run(_layer("micro_batch", "softmax"), xs, masks, slice(None))
    loss, _ = _run(_layer("micro_batch", "softmax"), xs, masks,
                   slice(rank * B // world, (rank + 1) * B // world))
    dist.all_reduce(loss)
    return float(loss / world), float(ref_loss)


def _worker(rank, world):
    """Every case in one spawn (process start is most of the cost)."""
    return {"cases": {case: _case(rank, world, *case) for case in CASES},
            "no_group": _no_group(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=120)


@pytest.mark.parametrize("case", CASES, ids=[f"{v}-{s}-accum{a}" for v, s, a in CASES])
def test_balance_loss_dp2_equals_one_process(results, case):
    got = [r["cases"][case] for r in results]
    assert got[0][2] is None, got[0][2]
    assert got[0] == got[1] and got[0][0] > 0


def test_without_balance_group_the_layout_shows(results):
    mean, ref = results[0]["no_group"]
    assert abs(mean - ref) > 1e-6
