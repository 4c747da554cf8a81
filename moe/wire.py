"""The wire format of the expert all-to-all (moe.dispatch_dtype): what a row is sent as.

Shapes: N rows, D channels, G = ceil(D / 128) tiles of a row (the last may be shorter).

Modes, and what each sends in each direction (dispatch = token rows to their experts,
combine = expert outputs back; backward = the gradients of each, sent the other way):

  mode   forward dispatch                        forward combine   both backwards
  auto   the compute dtype: autocast's dtype where autocast is on for the rows' device, else
         the rows' own dtype (bf16 under parallel.precision=bf16, fp32 under fp32)
  fp32   fp32                                    fp32              fp32
  bf16   bf16                                    bf16              bf16
  fp8    float8 e4m3 + one fp32 scale per 128    bf16              bf16
         channels of a row (DeepSeek-V3's fine-grained scaling), dequantized on arrival

The rounding to the wire format is part of the layer's function, not of the layout: one
process applies the same rounding at the same points (`round_trip`) as the expert-parallel
exchange does by sending the encoded rows (moe/all_to_all.py), so every layout computes the
same thing. Rounding is elementwise (fp8: per row tile), so it commutes with the row
permutations around the exchange. Gradients pass the fp8 quantization straight through.
Rows arrive in the compute dtype when the format rounded them (`arrival_dtype`: bf16 rows
under bf16 autocast stay bf16, no fp32 copy), else in their own; gradients go back in the
dtype the rows were sent from.
"""
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DISPATCH_DTYPES", "TILE", "Wire", "named_formats", "wire_formats", "arrival_dtype", "encode", "decode", "round_trip",
           "quantize_tiles", "dequantize_tiles", "wire_row_bytes"]

DISPATCH_DTYPES = ("auto", "fp32", "bf16", "fp8")
TILE = 128                            # channels per fp8 scale
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max      # 448
_NAMED = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Wire:
    """One exchange's format: `forward` a dtype or "fp8" (the rows sent), `backward` the
    dtype their gradients travel back in."""
    forward: object
    backward: torch.dtype

    @property
    def fp8(self) -> bool:
        return self.forward == "fp8"


def check_dispatch_dtype(mode) -> None:
    if mode not in DISPATCH_DTYPES:
        raise ValueError(f"dispatch_dtype={mode!r} (moe.dispatch_dtype) is not supported; use one "
                         f"of {DISPATCH_DTYPES}")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on for x's device, else x's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def arrival_dtype(x: torch.Tensor, fmt) -> torch.dtype:
    """The dtype rows sent from x in format `fmt` arrive in: x's own when the format is
    x's dtype (nothing was rounded), else the compute dtype (bf16 under bf16 autocast: the
    experts would cast to it anyway, so no fp32 copy of the rows is made)."""
    return x.dtype if fmt == x.dtype else compute_dtype(x)


def named_formats(mode: str) -> tuple:
    """(dispatch Wire, combine Wire) of a mode that names its formats (not auto)."""
    if mode == "fp8":
        return Wire("fp8", torch.bfloat16), Wire(torch.bfloat16, torch.bfloat16)
    dt = _NAMED[mode]
    return Wire(dt, dt), Wire(dt, dt)


def wire_formats(mode: str, x: torch.Tensor) -> tuple:
    """(dispatch Wire, combine Wire) of `mode` for rows like x (auto resolved here)."""
    if mode == "auto":
        dt = compute_dtype(x)
        return Wire(dt, dt), Wire(dt, dt)
    return named_formats(mode)


def wire_row_bytes(fmt, D: int) -> int:
    """Bytes one row of D channels takes on the wire in format `fmt` (a dtype or "fp8")."""
    if fmt == "fp8":
        return D + 4 * -(-D // TILE)
    return D * torch.empty((), dtype=fmt).element_size()


def quantize_tiles(x_ND: torch.Tensor):
    """-> (q_ND float8 e4m3, scale_NG fp32): scale = amax of the tile / 448 (1 for a tile of
    zeros), q = x / scale rounded to e4m3 (saturating at +-448 is then never needed)."""
    N, D = x_ND.shape
    G = -(-D // TILE)
    x = x_ND.float()
    pad = G * TILE - D
    tiles = torch.nn.functional.pad(x, (0, pad)).view(N, G, TILE)
    amax_NG = tiles.abs().amax(-1)
    scale_NG = torch.where(amax_NG > 0, amax_NG / E4M3_MAX, torch.ones_like(amax_NG))
    q = (tiles / scale_NG.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(N, G * TILE)[:, :D], scale_NG


def dequantize_tiles(q_ND: torch.Tensor, scale_NG: torch.Tensor, dtype) -> torch.Tensor:
    N, D = q_ND.shape
    G = scale_NG.shape[1]
    x = torch.nn.functional.pad(q_ND.float(), (0, G * TILE - D)).view(N, G, TILE)
    return (x * scale_NG.unsqueeze(-1)).view(N, G * TILE)[:, :D].to(dtype)


def encode(x_ND: torch.Tensor, fmt) -> torch.Tensor:
    """The payload of rows x_ND in format `fmt`: a tensor of that dtype, or for "fp8" uint8
    [N, D + 4G] (the e4m3 bytes, then the fp32 scales' bytes) so one exchange carries both."""
    if fmt != "fp8":
        return x_ND.to(fmt)
    q_ND, scale_NG = quantize_tiles(x_ND)
    return torch.cat([q_ND.contiguous().view(torch.uint8),
                      scale_NG.contiguous().view(torch.uint8)], 1)


def decode(payload: torch.Tensor, fmt, D: int, dtype) -> torch.Tensor:
    """Rows of `dtype` from encode's payload (D: the row width)."""
    if fmt != "fp8":
        return payload.to(dtype)
    q_ND = payload[:, :D].contiguous().view(E4M3)
    scale_NG = payload[:, D:].contiguous().view(torch.float32)
    return dequantize_tiles(q_ND, scale_NG, dtype)


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, wire: Wire):
        ctx.wire, ctx.in_dtype = wire, x_ND.dtype
        arrive = arrival_dtype(x_ND, wire.forward)
        return decode(encode(x_ND, wire.forward), wire.forward, x_ND.shape[-1], arrive)

    @staticmethod
    def backward(ctx, grad_ND):
        return grad_ND.to(ctx.wire.backward).to(ctx.in_dtype), None


def round_trip(x_ND: torch.Tensor, wire: Optional[Wire]) -> torch.Tensor:
    """x_ND as it arrives after an exchange in `wire` (one process: no exchange, the same
    rounding, the same arrival dtype); None or a lossless format: x_ND itself."""
    if wire is None or (not wire.fp8 and wire.forward == x_ND.dtype and wire.backward == x_ND.dtype):
        return x_ND
    return _RoundTrip.apply(x_ND, wire)
