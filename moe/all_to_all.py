"""All-to-all with variable split sizes, differentiable.

Shapes: N rows (dim 0), D row width, P ranks of the group.
Built on `all_to_all_single` with explicit split sizes because the list form of all_to_all
rejects uneven sizes on gloo. The backward of an exchange is the reverse exchange (swap the
split lists). Bytes are counted where every collective is seen, at the torch.distributed
boundary (parallel/ledger.py: kind expert_all_to_all), not here.

With a `wire` (moe/wire.py: moe.dispatch_dtype) the rows travel encoded (bf16, or fp8 bytes
with their tile scales) and are decoded on arrival into moe/wire.py's arrival_dtype; their
gradients travel back in the wire's backward dtype and arrive in the dtype the rows were sent
from.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .wire import arrival_dtype, decode, encode

__all__ = ["CollectiveCall", "all_to_all", "exchange_counts", "start_exchange", "start_exchange_in"]


@dataclass(frozen=True)
class CollectiveCall:
    """One all_to_all_single a dispatcher issues on the ep group per MoE layer and micro-batch.
    Its tables (moe/ep_dispatcher.py FLAT_CALLS, moe/hierarchical.py HIERARCHICAL_CALLS) are
    what the planner prices (parallel/planner/expert_nodes.py, comm.py) and what
    tests/unit/test_dispatch_calls.py holds the dispatchers to.

    size names, per rank: P ranks of the ep group, E experts, A rows it sends (its kept
    assignments), N rows its experts receive, U unique (token, node) rows it sends on the
    hierarchical hop 1, U1 rows it receives there as a proxy, A1 assignments it forwards as a
    proxy; d, c, b bytes of a row on the wire (moe/wire.py): forward dispatch, forward
    combine, either backward."""
    carries: str   # what travels
    phase: str     # "forward" (run again under recomputation) or "backward"
    reach: str     # "group": peers anywhere in the ep group; "node": on this rank's node only
    size: tuple    # the bytes this rank hands over: the product of these names and ints

    def nbytes(self, sizes: dict) -> float:
        out = 1
        for factor in self.size:
            out *= sizes[factor] if isinstance(factor, str) else factor
        return out


def start_exchange(x_ND, out_splits, in_splits, group, async_op: bool = True):
    """-> (out, work). async_op: the exchange is only issued, and `out` holds the received
    rows once `work.wait()` returned (moe/chunked_a2a.py overlaps it with compute); else it is
    done on return and work is None."""
    out = x_ND.new_empty((sum(out_splits),) + tuple(x_ND.shape[1:]))
    work = dist.all_to_all_single(out, x_ND.contiguous(), list(out_splits), list(in_splits),
                                  group=group, async_op=async_op)
    return out, work


def start_exchange_in(x_ND, out_splits, in_splits, group, fmt=None, arrive=None,
                      async_op: bool = True):
    """-> (out, work, finish): the exchange of x_ND's rows in format `fmt` (None: as they are)
    issued as start_exchange does; finish(out), once it is done, gives the received rows in
    `arrive` (None: x_ND's dtype), `out` itself when it already is."""
    as_is = fmt is None or fmt == x_ND.dtype
    payload = x_ND if as_is else encode(x_ND, fmt)
    out, work = start_exchange(payload, out_splits, in_splits, group, async_op=async_op)
    on_wire, D, dtype = (x_ND.dtype if as_is else fmt), x_ND.shape[-1], arrive or x_ND.dtype
    return out, work, lambda got: decode(got, on_wire, D, dtype)


def exchange_in(fmt, x_ND, out_splits, in_splits, group, arrive=None, waiter=None):
    """The rows of x_ND exchanged in format `fmt` (None: as they are), decoded into `arrive`
    (None: x_ND's dtype). waiter(work): issued asynchronously and waited for by the waiter
    (parallel/interleave.py: another micro-batch runs meanwhile); None: a blocking exchange."""
    out, work, finish = start_exchange_in(x_ND, out_splits, in_splits, group, fmt, arrive,
                                          async_op=waiter is not None)
    if waiter is not None:
        waiter(work)
    return finish(out)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group, wire, waiter):
        ctx.splits, ctx.group, ctx.wire, ctx.in_dtype = (out_splits, in_splits), group, wire, x_ND.dtype
        ctx.waiter = waiter
        if wire is None:
            return exchange_in(None, x_ND, out_splits, in_splits, group, waiter=waiter)
        return exchange_in(wire.forward, x_ND, out_splits, in_splits, group,
                           arrival_dtype(x_ND, wire.forward), waiter)

    @staticmethod
    def backward(ctx, grad_ND):
        out_splits, in_splits = ctx.splits
        fmt = None if ctx.wire is None else ctx.wire.backward
        # Rows came in as out_splits: send each rank's gradient back where its row came from,
        # arriving in the dtype the rows were sent from.
        grad = exchange_in(fmt, grad_ND, in_splits, out_splits, ctx.group, ctx.in_dtype, ctx.waiter)
        return grad, None, None, None, None, None


def all_to_all(x_ND: torch.Tensor, out_splits: list, in_splits: list, group=None,
               wire=None, waiter=None) -> torch.Tensor:
    """Send rows x_ND[sum(in_splits[:p]) : sum(in_splits[:p+1])] to rank p of `group`.

    Returns the received rows, ordered by source rank, `out_splits[p]` from rank p. Zero
    splits are fine. Differentiable: the gradient flows back by the reverse exchange, so
    every rank of the group must also run backward (or none). wire: a moe/wire.py Wire (the
    rows' format each way), or None (as they are). waiter: see exchange_in (both directions).
    """
    if x_ND.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all: x has {x_ND.shape[0]} rows but in_splits sum to "
                         f"{sum(in_splits)}")
    with torch.profiler.record_function("moe.all_to_all"):
        return _AllToAll.apply(x_ND, list(out_splits), list(in_splits), group, wire, waiter)


def exchange_counts(send_counts_PL: torch.Tensor, group=None) -> torch.Tensor:
    """Exchange a [P, L] integer table: row p goes to rank p; returns [P, L], row p from rank p.

    Used to tell each rank how many rows per local expert it will receive from each source.
    """
    recv_PL = torch.empty_like(send_counts_PL)
    dist.all_to_all_single(recv_PL, send_counts_PL.contiguous(), group=group)
    return recv_PL
