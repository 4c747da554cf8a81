"""moe.dispatch_dtype's wire formats (moe/wire.py) against hand-computed values, and the one-
process layer's rounding at the exchange points.

fp8 rows: one fp32 scale per 128 channels = the tile's amax / 448 (1 for a tile of zeros),
values x / scale rounded to float8 e4m3 (3 mantissa bits: relative rounding at most 2^-4 for
normal values), so the tile's largest value lands on 448 exactly and nothing saturates.
"""
import pytest
import torch

from moe import MoELayer
from moe.wire import (E4M3_MAX, TILE, Wire, decode, dequantize_tiles, encode, quantize_tiles,
                      round_trip, wire_formats, wire_row_bytes)

pytestmark = pytest.mark.lowp  # bf16 and fp8 results: .ci/run reruns them under other kernels
BF16 = torch.bfloat16


def test_tile_scales_by_hand():
    D = 2 * TILE + 44                       # two full tiles and a short one
    x = torch.zeros(3, D)
    x[0, :TILE] = torch.linspace(-2.0, 1.0, TILE)   # amax 2 -> scale 2/448
    x[0, TILE:2 * TILE] = 0.0                       # the zero tile: scale 1, all zeros
    x[0, 2 * TILE:] = 896.0                         # amax 896 -> scale 2, q = 448
    x[1] = 1e-3                                     # every tile: scale 1e-3/448, q = 448
    q, scale = quantize_tiles(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, D) and scale.shape == (3, 3)
    torch.testing.assert_close(scale[0], torch.tensor([2 / 448, 1.0, 2.0]), rtol=0, atol=0)
    assert torch.equal(scale[1], torch.full((3,), 1e-3) / 448)  # the same fp32 division
    assert torch.equal(scale[2], torch.ones(3))      # an all-zero row
    assert q[0, 0].float() == -E4M3_MAX               # -2 / (2/448): the tile's amax, exact
    assert torch.equal(q[0, TILE:2 * TILE].float(), torch.zeros(TILE))
    assert torch.equal(q[0, 2 * TILE:].float(), torch.full((44,), E4M3_MAX))
    assert torch.equal(q[1].float(), torch.full((D,), E4M3_MAX))
    y = dequantize_tiles(q, scale, torch.float32)
    # e4m3: 3 mantissa bits, a value rounds by at most half a step: 2^-4 relative (normals)
    normal = x.abs() >= 2 ** -6 * scale.repeat_interleave(TILE, 1)[:, :D]
    err = (y - x).abs()
    assert (err[normal] <= 2 ** -4 * x.abs()[normal]).all()
    assert torch.equal(y[0, TILE:2 * TILE], torch.zeros(TILE)) and torch.equal(y[2], torch.zeros(D))
    assert y[0, 0] == -2.0 and torch.equal(y[0, 2 * TILE:], torch.full((44,), 896.0))


def test_value_by_hand():
    """One tile [3, 1.1, 0, ...]: scale 3/448; 1.1 -> 1.1 x 448/3 = 164.27 -> e4m3 160 (the
    grid near 164 steps by 16 in [128, 256)), back 160 x 3/448 = 1.0714."""
    x = torch.zeros(1, TILE)
    x[0, 0], x[0, 1] = 3.0, 1.1
    q, scale = quantize_tiles(x)
    assert q[0, 1].float() == 160.0
    assert abs(dequantize_tiles(q, scale, torch.float32)[0, 1].item() - 160 * 3 / 448) < 1e-7


def test_encode_packs_bytes_and_decodes():
    x = torch.randn(7, 160) * 5
    payload = encode(x, "fp8")
    assert payload.dtype == torch.uint8 and payload.shape == (7, 160 + 4 * 2)
    assert wire_row_bytes("fp8", 160) == 168 and wire_row_bytes(BF16, 160) == 320
    assert wire_row_bytes(torch.float32, 7168) == 28672 and wire_row_bytes("fp8", 7168) == 7392
    want = dequantize_tiles(*quantize_tiles(x), torch.float32)
    assert torch.equal(decode(payload, "fp8", 160, torch.float32), want)
    assert torch.equal(decode(encode(x, BF16), BF16, 160, torch.float32), x.to(BF16).float())


def test_auto_is_the_compute_dtype():
    x = torch.randn(4, 8)
    assert wire_formats("auto", x) == (Wire(torch.float32, torch.float32),) * 2
    with torch.autocast("cpu", dtype=BF16):
        assert wire_formats("auto", x) == (Wire(BF16, BF16),) * 2
    assert wire_formats("auto", x.to(BF16)) == (Wire(BF16, BF16),) * 2
    assert wire_formats("fp8", x) == (Wire("fp8", BF16), Wire(BF16, BF16))
    assert wire_formats("bf16", x) == (Wire(BF16, BF16),) * 2


def test_round_trip_rounds_forward_and_backward():
    x = torch.randn(5, 160, requires_grad=True)
    y = round_trip(x, Wire("fp8", BF16))
    assert torch.equal(y, dequantize_tiles(*quantize_tiles(x.detach()), torch.float32))
    g = torch.randn(5, 160)
    y.backward(g)
    assert torch.equal(x.grad, g.to(BF16).float())  # straight through, in bf16
    assert round_trip(x, Wire(torch.float32, torch.float32)) is x


def _layer(mode):
    torch.manual_seed(0)
    return MoELayer(160, 64, 4, 2, dispatch_dtype=mode)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp8"])
def test_layer_rounds_at_the_exchange_points(mode):
    """One process: the dispatched rows and the expert outputs are what arrives after an
    exchange in the mode's format, and the gradients cross it in the backward format: the
    layer equals the fp32 layer with those roundings written out by hand."""
    x = torch.randn(2, 6, 160)
    got_layer, ref_layer = _layer(mode), _layer("fp32")
    disp, comb = wire_formats(mode, x)

    def experts_by_hand(x_ND, counts, extend, padded=False, gate_N=None):   # rows in and out, rounded
        y_ND = ref_layer.experts(round_trip(x_ND, disp), counts, extend, padded, gate_N=gate_N)
        return round_trip(y_ND, comb)
    ref_layer._run_experts = experts_by_hand
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [got_layer(xs[0]), ref_layer(xs[1])]
    gy = torch.randn_like(outs[0])
    for o in outs:
        o.backward(gy)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)
    for (n, a), (_, b) in zip(got_layer.named_parameters(), ref_layer.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=n)
    if mode != "fp32":  # and the rounding is really there
        assert not torch.equal(outs[0], _layer("fp32")(x))


def test_bad_mode_names_the_field():
    with pytest.raises(ValueError, match=r"moe\.dispatch_dtype.*auto"):
        MoELayer(16, 32, 4, 2, dispatch_dtype="fp16")


def test_rows_arrive_in_the_compute_dtype():
    """Under bf16 autocast the rounded rows arrive in bf16 (no fp32 copy; the experts would
    cast to it anyway) and their gradients go back in the dtype they were sent from."""
    x = torch.randn(5, 160, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        for mode in ("auto", "bf16", "fp8"):
            y = round_trip(x, wire_formats(mode, x)[0])
            assert y.dtype == BF16, mode
            (g,) = torch.autograd.grad(y.float().sum(), x)
            assert g.dtype == torch.float32 and torch.equal(g, torch.ones_like(g))
        assert round_trip(x, wire_formats("fp32", x)[0]) is x   # fp32 rows: nothing rounded
    y = round_trip(x, Wire(BF16, BF16))                        # fp32 compute: back to fp32
    assert y.dtype == torch.float32 and torch.equal(y, x.detach().to(BF16).float())
