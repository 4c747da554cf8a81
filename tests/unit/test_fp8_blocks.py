"""Fine-grained FP8 quantization (moe/fp8.py) against hand-computed scales and values: the
1 x 128 activation tiles, the 128 x 128 weight blocks, e4m3 rounding and its largest value,
the zero tile, and the emulated GEMM against the fp32 GEMM of the rounded operands."""
import pytest
import torch

from moe.fp8 import dequantize_blocks, fp8_matmul, qdq_blocks, qdq_cols, qdq_rows, quantize_blocks


def test_weight_blocks_scale_by_their_own_amax():
    w = torch.zeros(256, 128)
    w[0, 0], w[5, 7] = 896.0, -3.0          # block (0, 0): amax 896 -> scale 2
    w[200, 100] = 0.5                        # block (1, 0): amax 0.5 -> scale 0.5 / 448
    q, scale = quantize_blocks(w)
    assert scale.shape == (2, 1)
    assert scale[0, 0].item() == 2.0 and scale[1, 0].item() == pytest.approx(0.5 / 448)
    assert q.dtype == torch.float8_e4m3fn
    assert q[0, 0].float().item() == 448.0 and q[5, 7].float().item() == -1.5
    assert q[200, 100].float().item() == 448.0
    back = dequantize_blocks(q, scale)
    assert back[0, 0].item() == 896.0 and back[5, 7].item() == -3.0
    assert back[200, 100].item() == pytest.approx(0.5)


def test_zero_block_has_scale_one_and_stays_zero():
    q, scale = quantize_blocks(torch.zeros(128, 256))
    assert scale.tolist() == [[1.0, 1.0]] and q.float().abs().sum().item() == 0


def test_e4m3_rounding_of_one_tile():
    """A tile with amax 448 has scale 1: values round to e4m3's grid (3 mantissa bits: the
    spacing between 1 and 2 is 1/8, between 256 and 448 it is 32)."""
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([448.0, 1.06, 1.07, 300.0])
    got = qdq_rows(x)[0, :4].tolist()
    assert got == [448.0, 1.0, 1.125, 288.0]


def test_bank_blocks_are_per_expert_and_odd_dims_are_refused():
    bank = torch.randn(3, 128, 256)
    bank[1] *= 1000
    _, scale = quantize_blocks(bank)
    assert scale.shape == (3, 1, 2) and (scale[1] > 100 * scale[0]).all()
    with pytest.raises(ValueError, match=r"multiple of 128 \(got 128 x 200\)"):
        quantize_blocks(torch.randn(128, 200))


def test_emulated_gemm_is_the_fp32_gemm_of_the_rounded_operands_backward_too():
    """Forward: x per 1 x 128 tile, w per 128 x 128 block. Backward (DeepSeek-V3's): dx from
    dy tiled 1 x 128 along N against the same blocks; dw from x and dy tiled 128 x 1 along T.
    T = 200 leaves a partial tile along T (padded with zeros for its amax)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 256, generator=g, requires_grad=True)
    w = torch.randn(256, 128, generator=g, requires_grad=True)
    y = fp8_matmul(x, w)
    want = qdq_rows(x.detach()) @ qdq_blocks(w.detach())
    assert torch.equal(y.detach(), want)
    rel = (y.detach() - x.detach() @ w.detach()).norm() / (x.detach() @ w.detach()).norm()
    assert 1e-3 < rel < 0.06                 # e4m3: 3 mantissa bits, a few per cent per GEMM
    dy = torch.randn(200, 128, generator=g)
    y.backward(dy)
    assert torch.equal(x.grad, qdq_rows(dy) @ qdq_blocks(w.detach()).mT)
    assert torch.equal(w.grad, qdq_cols(x.detach()).mT @ qdq_cols(dy))
    # by hand: column k of x along T is its own tiles: rows 0-127 and 128-199 scale apart
    col = x.detach()[:, 3].clone()
    assert torch.equal(qdq_cols(x.detach())[:128, 3], qdq_rows(col[None, :128])[0])
    assert torch.equal(qdq_cols(x.detach())[128:, 3], qdq_rows(col[None, 128:])[0])
    assert (w.grad - x.detach().mT @ dy).norm() / (x.detach().mT @ dy).norm() < 0.06


def test_emulated_gemm_ignores_autocast_and_returns_the_input_dtype():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 128, generator=g).bfloat16()
    w = torch.randn(128, 128, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_matmul(x, w)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (qdq_rows(x) @ qdq_blocks(w)).bfloat16())
