"""All-to-all with variable split sizes, differentiable, plus a byte counter.

Shapes: N rows (dim 0), D row width, P ranks of the group.
Built on `all_to_all_single` with explicit split sizes because the list form of all_to_all
rejects uneven sizes on gloo. The backward of an exchange is the reverse exchange (swap the
split lists). A `CommCounter` is passed in by the caller (one per layer, say), so counting
needs no global state.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "all_to_all", "exchange_counts"]


@dataclass
class CommCounter:
    """Bytes moved by the all-to-alls of one owner (e.g. one MoE layer).

    `payload_bytes` counts every row given to all_to_all_single in forward, including the
    rows a rank keeps for itself; summed over the ranks of a group it equals the kept
    routed-token bytes (dispatch) plus the same again (combine), which in dropless mode is
    2 * T * K * D * bytes per element. `remote_bytes` is the part that leaves the rank.
    `backward_bytes` is the reverse exchange during backward; `count_bytes` the split-size
    exchange that precedes each token exchange.
    """
    calls: int = 0
    payload_bytes: int = 0
    remote_bytes: int = 0
    backward_bytes: int = 0
    count_bytes: int = 0

    def reset(self) -> None:
        self.calls = self.payload_bytes = self.remote_bytes = 0
        self.backward_bytes = self.count_bytes = 0

    def _forward(self, send_splits, row_bytes: int, rank: int) -> None:
        total = sum(send_splits) * row_bytes
        self.calls += 1
        self.payload_bytes += total
        self.remote_bytes += total - send_splits[rank] * row_bytes


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _exchange(x_ND, out_splits, in_splits, group):
    out = x_ND.new_empty((sum(out_splits),) + tuple(x_ND.shape[1:]))
    dist.all_to_all_single(out, x_ND.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group, counter):
        ctx.splits, ctx.group, ctx.counter = (out_splits, in_splits), group, counter
        ctx.row_bytes = _row_bytes(x_ND)
        if counter is not None:
            counter._forward(in_splits, ctx.row_bytes, dist.get_rank(group))
        return _exchange(x_ND, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_ND):
        out_splits, in_splits = ctx.splits
        if ctx.counter is not None:
            ctx.counter.backward_bytes += sum(out_splits) * ctx.row_bytes
        # Rows came in as out_splits: send each rank's gradient back where its row came from.
        return _exchange(grad_ND, in_splits, out_splits, ctx.group), None, None, None, None


def all_to_all(x_ND: torch.Tensor, out_splits: list, in_splits: list, group=None,
               counter: CommCounter = None) -> torch.Tensor:
    """Send rows x_ND[sum(in_splits[:p]) : sum(in_splits[:p+1])] to rank p of `group`.

    Returns the received rows, ordered by source rank, `out_splits[p]` from rank p. Zero
    splits are fine. Differentiable: the gradient flows back by the reverse exchange, so
    every rank of the group must also run backward (or none).
    """
    if x_ND.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all: x has {x_ND.shape[0]} rows but in_splits sum to "
                         f"{sum(in_splits)}")
    with torch.profiler.record_function("moe.all_to_all"):
        return _AllToAll.apply(x_ND, list(out_splits), list(in_splits), group, counter)


def exchange_counts(send_counts_PL: torch.Tensor, group=None,
                    counter: CommCounter = None) -> torch.Tensor:
    """Exchange a [P, L] integer table: row p goes to rank p; returns [P, L], row p from rank p.

    Used to tell each rank how many rows per local expert it will receive from each source.
    """
    recv_PL = torch.empty_like(send_counts_PL)
    dist.all_to_all_single(recv_PL, send_counts_PL.contiguous(), group=group)
    if counter is not None:
        counter.count_bytes += send_counts_PL.numel() * send_counts_PL.element_size()
    return recv_PL
