"""Fine-grained FP8 quantization (moe/fp8.py) against hand-computed scales and values: the
1 x 128 activation tiles, the 128 x 128 weight blocks, e4m3 rounding and its largest value,
the zero tile, and the emulated GEMM, forward and backward, against a float64 GEMM of operands
rounded by hand (tests/unit/fp8_reference.py)."""
import pytest
import torch

from moe.fp8 import dequantize_blocks, fp8_matmul, qdq_blocks, qdq_rows, quantize_blocks
from tests.unit.fp8_reference import BLOCKS, COLS, ROWS, e4m3, fp32_gemm_bound, qdq


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


def test_hand_e4m3_rounding_is_e4m3():
    """The reference's rounding (tests/unit/fp8_reference.py), written from the format, on
    values whose e4m3 neighbours are known: normal spacing 2^(e-3), ties to even, the
    subnormals spaced 2^-9, the largest value 448."""
    v = torch.tensor([448.0, 1.06, 1.07, 300.0, 1.0625, 1.1875, 2.0 ** -9 * 0.6, 2.0 ** -9 * 0.4,
                      -0.0703125, 17.0, 19.0])
    want = [448.0, 1.0, 1.125, 288.0, 1.0, 1.25, 2.0 ** -9, 0.0, -0.0703125, 16.0, 20.0]
    assert e4m3(v).tolist() == want
    assert v.to(torch.float8_e4m3fn).float().tolist() == want     # torch's cast agrees


def test_emulated_gemm_is_the_gemm_of_the_hand_rounded_operands_backward_too():
    """Forward: x per 1 x 128 tile, w per 128 x 128 block. Backward (DeepSeek-V3's): dx from
    dy tiled 1 x 128 along N against the same blocks; dw from x and dy tiled 128 x 1 along T.
    T = 200 leaves a partial tile along T (its own scale). The expectation is
    tests/unit/fp8_reference.py: scales amax / 448 and e4m3 rounding written out per tile,
    dequantized and multiplied in float64 -- nothing of moe/fp8.py or moe/wire.py. Allowed:
    fp32 rounding only (the emulation dequantizes and accumulates in fp32: fp32_gemm_bound,
    about 1.5e-5 of |a| |b| at K = 256); one FP8 rounding wrong anywhere (a bf16 backward, a
    wrong tile, scale or constant) moves elements by up to 2^-4 of their terms."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 256, generator=g, requires_grad=True)
    w = torch.randn(256, 128, generator=g, requires_grad=True)
    y = fp8_matmul(x, w)
    xd, wd = x.detach(), w.detach()
    qx, qw = qdq(xd, ROWS), qdq(wd, BLOCKS)
    err = (y.detach().double() - qx @ qw).abs()
    assert (err <= fp32_gemm_bound(qx.abs(), qw.abs())).all(), err.max().item()
    rel = (y.detach() - xd @ wd).norm() / (xd @ wd).norm()
    assert 1e-3 < rel < 0.06                 # e4m3: 3 mantissa bits, a few per cent per GEMM
    dy = torch.randn(200, 128, generator=g)
    y.backward(dy)
    qdy = qdq(dy, ROWS)
    err = (x.grad.double() - qdy @ qw.T).abs()
    assert (err <= fp32_gemm_bound(qdy.abs(), qw.abs().T)).all(), ("dx", err.max().item())
    qxc, qdyc = qdq(xd, COLS), qdq(dy, COLS)
    err = (w.grad.double() - qxc.T @ qdyc).abs()
    assert (err <= fp32_gemm_bound(qxc.abs().T, qdyc.abs())).all(), ("dw", err.max().item())
    assert (w.grad - xd.mT @ dy).norm() / (xd.mT @ dy).norm() < 0.06


def test_emulated_gemm_ignores_autocast_and_returns_the_input_dtype():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 128, generator=g).bfloat16()
    w = torch.randn(128, 128, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_matmul(x, w)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (qdq_rows(x) @ qdq_blocks(w)).bfloat16())
