"""The dense parts on the fast paths (issue 59): the norm takes torch's fused kernel under
autocast, the loss walks the vocabulary without an fp32 copy of the logits, AdamW picks its
fused implementation on CUDA. Each is checked against the path it replaces.

Tolerances: the chunked loss equals F.cross_entropy's to 1e-6 relative (the same fp32
arithmetic per row, another order of the sum over rows) and its gradient to 1e-6 of the
largest entry; the fused norm under bf16 autocast equals torch's kernel on a bf16 weight
exactly and the fp32 composite to bf16 rounding (2e-2); fused and for-loop AdamW agree to
1e-6 after 3 steps (fp32, another order of the same operations).
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models.cross_entropy import chunk_rows, chunked_cross_entropy
from models.layers import RMSNorm, make_norm
from optim.build import adamw_impl


def test_rmsnorm_fused_under_autocast():
    torch.manual_seed(0)
    norm = make_norm("rmsnorm", 16, 1e-6)
    assert isinstance(norm, RMSNorm)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when mixed dtypes miss the fused kernel
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x)
    assert y.dtype == torch.bfloat16
    fused = F.rms_norm(x, (16,), norm.weight.detach().bfloat16(), 1e-6)
    assert torch.equal(y, fused)
    composite = F.rms_norm(x.float(), (16,), norm.weight.detach(), 1e-6)
    assert torch.allclose(y.float(), composite, atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert norm.weight.dtype == torch.float32 and norm.weight.grad.dtype == torch.float32


def test_rmsnorm_fp32_is_torchs():
    torch.manual_seed(0)
    ours, theirs = RMSNorm(16, eps=1e-5), nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 16)
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 4 * 50 * 4])  # one chunk; chunks of 4 rows
def test_chunked_cross_entropy_equals_torch(dtype, chunk_bytes):
    torch.manual_seed(0)
    logits = (torch.randn(37, 50) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (37,))
    labels[[0, 3, 36]] = -100
    ref = F.cross_entropy(logits.float(), labels, ignore_index=-100)
    ref.backward()
    ref_grad, logits.grad = logits.grad.clone(), None
    got = chunked_cross_entropy(logits, labels, chunk_bytes)
    (got * 1.0).backward()
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert logits.grad.dtype == dtype
    err = (logits.grad.float() - ref_grad.float()).abs().max().item()
    assert err <= 1e-6 * ref_grad.abs().max().item() + (0 if dtype == torch.float32 else 1e-9), err


def test_chunk_rows():
    assert chunk_rows(16384, 151936) == 1766  # 1 GiB of fp32 rows of Qwen3's vocabulary
    assert chunk_rows(10, 50) == 10 and chunk_rows(10, 1 << 30) == 1


def _steps(impl: str) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **adamw_impl(impl, model))
    x, losses = torch.randn(32, 8), []
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses + [p.detach().clone() for p in model.parameters()]


def test_adamw_implementations_agree():
    assert adamw_impl("auto", nn.Linear(2, 2)) == {}  # CPU: torch's default
    ref = _steps("for_loop")
    for impl in ("fused", "foreach"):
        got = _steps(impl)
        for a, b in zip(ref, got):
            assert torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-6, atol=1e-6), impl


def test_adamw_impl_kwargs():
    assert adamw_impl("fused", nn.Linear(2, 2)) == {"fused": True, "foreach": False}
    assert adamw_impl("foreach", nn.Linear(2, 2)) == {"fused": False, "foreach": True}
    assert adamw_impl("for_loop", nn.Linear(2, 2)) == {"fused": False, "foreach": False}
    if torch.cuda.is_available():
        assert adamw_impl("auto", nn.Linear(2, 2).cuda()) == {"fused": True}


def test_chunked_cross_entropy_moves_the_logits_three_times():
    """The op census of the loss's forward and backward (models/cross_entropy.py: one fused
    op per chunk and direction): the bf16 logits read in the forward, read and their gradient
    written in the backward, plus per-row vectors (under 128 bytes a row) -- F.cross_entropy(logits.float()) moves
    about 13 times the logits' bytes."""
    from moe.profiling.census import OpCensus
    logits = torch.randn(64, 1000, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (64,))
    size = logits.numel() * logits.element_size()
    with OpCensus() as ours:
        chunked_cross_entropy(logits, labels, chunk_bytes=4 * 1000 * 16).backward()
    with OpCensus() as torchs:
        F.cross_entropy(logits.float(), labels).backward()
    assert ours.syncs == 0 and ours.bytes <= 3 * size + 64 * 128, (ours.bytes / size, dict(ours.bytes_by_op))
    assert torchs.bytes > 10 * size, torchs.bytes / size


def test_grad_norm_is_a_few_foreach_kernels():
    """parallel/grads.grad_norm: the weighted global norm sqrt(sum w |g|^2) in one
    torch._foreach_norm per (weight, dtype, device) group, not four kernels per tensor; equal
    to the per-tensor sum to 1e-6."""
    from moe.profiling.census import OpCensus
    from parallel.grads import grad_norm
    torch.manual_seed(0)
    grads = [torch.randn(7, 5) for _ in range(40)] + [torch.randn(3, dtype=torch.bfloat16)]
    items = [(g, 1.0 if i % 3 else 0.5) for i, g in enumerate(grads)]
    ref = sum(w * g.float().pow(2).sum() for g, w in items).sqrt()
    with OpCensus() as census:
        got = grad_norm(items, torch.device("cpu"), False)
    assert torch.allclose(got, ref, rtol=1e-6), (got, ref)
    assert census.ops <= 25 and census.syncs == 0, dict(census.by_op)
