"""Context-parallel attention (parallel/context/) against one process's attention.

Same q, k, v and output gradient on every rank (seeded); the one-process reference is
F.scaled_dot_product_attention over the whole sequence (causal and not). Each rank runs its
balanced chunks (split.py) through ring_attention or ulysses_attention; its output and its
q/k/v gradients must equal the reference's rows at its positions. fp32 tolerance: 2e-5
absolute on values of order 1 (block-wise log-sum-exp merging reorders the sums).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context.ring import ring_attention
from parallel.context.split import attention_work, split
from parallel.context.ulysses import ulysses_attention
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
B, H, S, Dh, TOL = 2, 4, 32, 8, 2e-5


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(B, H, S, Dh, generator=g) for _ in range(4))
    return q, k, v, d_out


def _reference(causal):
    q, k, v, d_out = _inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(d_out)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world, mode, causal, rows=None):
    group = dist.group.WORLD
    if rows is not None:  # the ring's query-row tiles, smaller than a chunk and not dividing it
        import parallel.context.ring as ring
        ring.ROWS = rows
    q, k, v, d_out = (split(t, world, rank, dim=2) for t in _inputs())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    attend = ring_attention if mode == "ring" else ulysses_attention
    out = attend(q, k, v, group, causal=causal)
    out.backward(d_out)
    want = [split(t, world, rank, dim=2) for t in _reference(causal)]
    got = [out.detach(), q.grad, k.grad, v.grad]
    return [float((a - b).abs().max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("world,mode,causal,rows", [(2, "ring", True, None), (4, "ring", True, None),
                                                    (2, "ring", False, None), (2, "ring", True, 3),
                                                    (2, "ulysses", True, None),
                                                    (4, "ulysses", True, None)])
def test_context_attention_equals_one_process(world, mode, causal, rows):
    for rank, errs in enumerate(run_distributed(_worker, world, mode, causal, rows)):
        names = ["output", "dq", "dk", "dv"]
        bad = {n: e for n, e in zip(names, errs) if e > TOL}
        assert not bad, f"cp={world} {mode} causal={causal} rank {rank}: {bad}"


def test_balanced_chunks_equalise_causal_work():
    """The balanced order gives every rank 2n+1 chunk pairs; the contiguous split (the
    mutation: rank r holding chunks 2r, 2r+1) gives the last rank 4n-1 pairs against a
    mean of 2n+1: 1.4x at n=2, 1.67x at n=4, 1.82x at n=8, towards 2x."""
    for n in (2, 4, 8):
        balanced = [attention_work(n, r) for r in range(n)]
        assert balanced == [2 * n + 1] * n
        contiguous = [attention_work(n, r, balanced=False) for r in range(n)]
        assert max(contiguous) == 4 * n - 1 and sum(contiguous) == n * (2 * n + 1)
