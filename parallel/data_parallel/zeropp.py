"""ZeRO++ (Wang et al. 2023) communication: block-quantized int8 collectives.

  qwZ  parallel.zeropp_quantize_weights  ZeRO-3 parameter all-gathers carry int8 blocks plus
       one fp32 scale per block, dequantized after the gather (QuantizedAllGather, installed
       on every FSDP2 module through set_custom_all_gather).
  qgZ  parallel.zeropp_quantize_grads    the gradient reduce-scatter becomes one all-to-all of
       int8 blocks: each rank quantizes the P chunks of its full gradient, sends chunk j to
       rank j, and sums the P chunks it receives in fp32 after dequantizing
       (quantized_reduce_scatter; FSDP2 through set_custom_reduce_scatter, ZeRO-2's slices
       directly). The paper's hierarchical variant first reduces inside a node; on one
       all-to-all hop each value is quantized exactly once, which keeps the error at one
       rounding per contribution.
  hpZ  parallel.zeropp_hpz is FSDP2's reshard_after_forward=<ranks> (fsdp.py), not here.

Quantization: symmetric, per block of BLOCK values: scale = max|x| / 127, q = round(x / scale).
Bytes per value: 1 + 4/BLOCK (= 1.016 at BLOCK=256), i.e. 0.254x of fp32 and 0.51x of bf16.
The gathered weights are the dequantized ones on every rank (the owner's included), so all
ranks compute with the same values; gradients flow to the fp32 shards unchanged
(straight-through), as in the paper.

Shapes: N values, NB = ceil(N / BLOCK) blocks, P ranks in the group.
"""
import contextlib

import torch
import torch.distributed as dist

from ..reduce import all_gather_single

BLOCK = 256
QMAX = 127.0


def quantize(x_N: torch.Tensor, block: int = BLOCK):
    """(q_int8 [NB*block], scale_fp32 [NB]) of a flat tensor, zero-padded to whole blocks."""
    n = x_N.numel()
    nb = -(-n // block)
    x_BK = torch.zeros(nb * block, dtype=torch.float32, device=x_N.device)
    x_BK[:n] = x_N.reshape(-1)
    x_BK = x_BK.view(nb, block)
    scale_B = x_BK.abs().amax(dim=1) / QMAX
    safe_B = torch.where(scale_B > 0, scale_B, torch.ones_like(scale_B))
    q_BK = torch.round(x_BK / safe_B[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q_BK.view(-1), scale_B


def dequantize(q: torch.Tensor, scale_B: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """fp32 [n] from quantize's output."""
    return (q.view(-1, block).to(torch.float32) * scale_B[:, None]).view(-1)[:n]


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def quantized_all_gather(output_N: torch.Tensor, input_n: torch.Tensor, group) -> None:
    """all_gather_into_tensor(output, input) with int8 blocks on the wire."""
    P, n = dist.get_world_size(group), input_n.numel()
    q, scale = quantize(input_n)
    q_all = q.new_empty(P * q.numel())
    scale_all = scale.new_empty(P * scale.numel())
    all_gather_single(q_all, q, group=group)
    all_gather_single(scale_all, scale, group=group)
    rows = [dequantize(qr, sr, n) for qr, sr in zip(q_all.view(P, -1), scale_all.view(P, -1))]
    output_N.view(P, n).copy_(torch.stack(rows))


def quantized_reduce_scatter(output_n: torch.Tensor, input_N: torch.Tensor, group=None,
                             op=dist.ReduceOp.SUM) -> None:
    """reduce_scatter_tensor(output, input, SUM or AVG) as one int8 all-to-all plus a local
    fp32 sum (same signature as dist.reduce_scatter_tensor for the ZeRO-2 slices)."""
    P, n = dist.get_world_size(group), output_n.numel()
    chunks = [quantize(c) for c in input_N.view(P, n)]
    q_send = torch.cat([q for q, _ in chunks])
    s_send = torch.cat([s for _, s in chunks])
    q_recv, s_recv = torch.empty_like(q_send), torch.empty_like(s_send)
    dist.all_to_all_single(q_recv, q_send, group=group)
    dist.all_to_all_single(s_recv, s_send, group=group)
    total_n = sum(dequantize(qr, sr, n) for qr, sr in zip(q_recv.view(P, -1), s_recv.view(P, -1)))
    if op == dist.ReduceOp.AVG:
        total_n = total_n / P
    elif op != dist.ReduceOp.SUM:
        raise ValueError(f"quantized reduce-scatter supports SUM and AVG, got {op}")
    output_n.copy_(total_n)


def labelled_reduce_scatter(comm_label):
    """quantized_reduce_scatter booked as the ledger's zero_grad_reduce_scatter (an all-to-all
    on a group that may also be the ep group could not be told from token dispatch)."""
    def reduce_scatter(output_n, input_N, group=None, op=dist.ReduceOp.SUM):
        with _label(comm_label, "zero_grad_reduce_scatter"):
            quantized_reduce_scatter(output_n, input_N, group, op)
    return reduce_scatter


def _label(comm_label, kind):
    return comm_label(kind) if comm_label is not None else contextlib.nullcontext()


def fsdp_comms(weights: bool, grads: bool, comm_label=None):
    """(all_gather, reduce_scatter) objects for FSDP2's set_custom_* (None where not asked)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    reduce_scatter = labelled_reduce_scatter(comm_label)

    class _Alloc:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    class QuantizedAllGather(_Alloc, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if not _is_float(input_tensor):  # mixed-dtype groups arrive as raw bytes
                return all_gather_single(output_tensor, input_tensor, group=group,
                                                   async_op=async_op)
            with _label(comm_label, "zero_param_gather"):
                quantized_all_gather(output_tensor, input_tensor, group)
            return None

    class QuantizedReduceScatter(_Alloc, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            reduce_scatter(output_tensor, input_tensor, group, op)
            return None

    return (QuantizedAllGather() if weights else None,
            QuantizedReduceScatter() if grads else None)
