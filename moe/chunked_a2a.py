"""Expert-parallel all-to-all overlapped with expert compute (moe.a2a_overlap_degree = d).

Shapes: A rows this rank sends, in send order (destination rank p, then slot w), N rows a
chunk brings here, P ranks of the ep group, W expert slots per rank, T tokens, D model dim.

The dispatch is planned once (routing, capacity drops, replica placement: ep_dispatcher.
SendPlan), then every (source, destination, slot) block of rows is cut into d contiguous,
near-equal pieces: chunk c holds piece c of every block, so each chunk is an ordinary
exchange (its own splits and slot counts) and every row is computed exactly once by the
expert it was routed to: the same function as d = 1, rows merely grouped differently.

Forward, per rank:  issue dispatch 0 -> shared experts (while it flies) -> for each chunk c:
issue dispatch c+1, wait dispatch c, compute experts on c, issue combine c -> wait the
combines -> weighted combine. Backward overlaps the same way without extra code: each
exchange is two autograd nodes (_Issue, _Wait). _Wait's backward issues the reverse exchange
of the gradient and returns at once; _Issue's backward waits for it and returns its result,
and autograd runs the other chunks' expert backward in between (it runs later-created nodes first). No host sync is added: the
splits are the host ints the count exchange already produced, and on CUDA `wait` only makes
the compute stream wait for the communication stream.
"""
import contextlib

import numpy as np
import torch

from .all_to_all import start_exchange_in
from .wire import arrival_dtype
from .dispatcher import permute_rows, weighted_combine
from .ep_dispatcher import EPDispatchMeta

__all__ = ["chunk_tables", "overlapped_experts"]


class _Pending:
    """The work handle of one in-flight exchange, handed from _Issue to _Wait (and back in
    backward). One per exchange, created by the caller: no state outlives the step. wire:
    the rows' format each way (moe/wire.py), or None."""
    __slots__ = ("work", "name", "timeline", "wire", "raw", "finish", "in_dtype")

    def __init__(self, name, timeline, wire):
        self.work, self.name, self.timeline, self.wire = None, name, timeline, wire
        self.raw, self.finish, self.in_dtype = None, None, None  # in_dtype: the rows sent

    def issue(self, x, out_splits, in_splits, group, name, fmt, arrive):
        """Start the exchange of x in format fmt (None: as it is, moe/all_to_all.py), the rows
        to arrive in `arrive`; -> the buffer it fills when that already holds them, else None
        (they travel encoded or change dtype: `wait` decodes them)."""
        self.raw, self.work, self.finish = start_exchange_in(x, out_splits, in_splits, group, fmt, arrive)
        if self.timeline is not None:
            self.timeline.issued(name)
        return self.raw if self.raw.dtype == arrive else None

    def wait(self, name):
        """-> the received rows (decoded into the arrival dtype issue() was given)."""
        span = contextlib.nullcontext() if self.timeline is None else self.timeline.span("wait", name)
        with span:
            self.work.wait()
        self.work, got, self.raw = None, self.raw, None
        return self.finish(got)


def _fmt(wire, backward: bool):
    return None if wire is None else (wire.backward if backward else wire.forward)


class _Issue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, pending, out_splits, in_splits, group):
        ctx.pending = pending
        pending.in_dtype = x_ND.dtype
        fmt = _fmt(pending.wire, False)
        arrive = x_ND.dtype if fmt is None else arrival_dtype(x_ND, fmt)
        out = pending.issue(x_ND, out_splits, in_splits, group, pending.name, fmt, arrive)
        # encoded rows: a placeholder links _Issue to _Wait (one element, never read)
        return out if out is not None else \
            x_ND.new_empty((1, 1), dtype=arrive).expand(sum(out_splits), x_ND.shape[-1])

    @staticmethod
    def backward(ctx, _grad_out):   # the tensor _Wait's backward is sending
        pending = ctx.pending
        grad_in = pending.wait(pending.name + " bwd")   # the reverse exchange _Wait issued
        return grad_in, None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, pending, out_splits, in_splits, group):
        ctx.pending, ctx.splits, ctx.group = pending, (out_splits, in_splits), group
        got = pending.wait(pending.name)
        return got.view_as(got) if got is out else got

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        # _Issue's backward waits for it and returns what arrived
        ctx.pending.issue(grad, in_splits, out_splits, ctx.group, ctx.pending.name + " bwd",
                          _fmt(ctx.pending.wire, True), ctx.pending.in_dtype)
        return grad, None, None, None, None


def _start(x_ND, out_splits, in_splits, group, name, timeline, wire=None):
    pending = _Pending(name, timeline, wire)
    return _Issue.apply(x_ND, pending, tuple(out_splits), tuple(in_splits), group), pending


def _finish(started, out_splits, in_splits, group):
    out, pending = started
    return _Wait.apply(out, pending, tuple(out_splits), tuple(in_splits), group)


def chunk_tables(table_PPW, degree: int) -> list:
    """d tables summing to table_PPW: chunk c gets rows [n*c//d, n*(c+1)//d) of each block."""
    return [table_PPW * (c + 1) // degree - table_PPW * c // degree for c in range(degree)]


def _send_rows(table_PPW, rank: int, degree: int, c: int) -> torch.Tensor:
    """long [rows of chunk c]: their positions in this rank's send buffer (blocks in
    (destination, slot) order, chunk c's piece of each). Host arithmetic (numpy)."""
    n = np.asarray(table_PPW)[rank].reshape(-1)
    block_start = np.cumsum(n) - n
    lo, cnt = n * c // degree, n * (c + 1) // degree - n * c // degree
    out_start = np.cumsum(cnt) - cnt
    rows = np.repeat(block_start + lo - out_start, cnt) + np.arange(int(cnt.sum()))
    return torch.tensor(rows.tolist(), dtype=torch.long)


class _AfterBackward(torch.autograd.Function):
    """Identity whose backward calls fn() first: on the rows every chunk is cut from, it runs
    once all chunks' expert backward is done."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


def overlapped_experts(dispatcher, x_TD, routing, run_experts, degree: int, out_dtype,
                       in_flight=None, timeline=None, wires=(None, None), release=None,
                       gated: bool = False):
    """-> (y_TD, meta, in_flight()'s result): the routed experts' combined output for x_TD, the dispatch cut into
    `degree` chunks whose exchanges overlap the experts of the previous chunk.

    run_experts(x_ND, counts_L, extend) -> y_ND computes rows already grouped by local slot
    (extend: ExpertBank.forward's; replica weights are fetched once, by the first chunk).
    in_flight() runs while the first dispatch is in flight (the layer's shared experts) and
    its result is returned third. timeline: a moe/profiling/timeline.py Timeline, or None.
    wires: the (dispatch, combine) formats of the rows on the wire (moe/wire.py).
    release(): called once the experts are done with every chunk, in forward and in backward
    (ZeRO-3 holds their gathered weights across the chunks, then frees them: parallel/
    data_parallel/fsdp.py), or None. gated: the routing gates go to the experts with each
    chunk's rows (fp32, an exchange of their own) and run_experts applies them (moe.
    gates_in_experts); the combine then sums."""
    sp = dispatcher.plan(x_TD, routing)
    x_AD = sp.x_AD if release is None or not sp.x_AD.requires_grad else _AfterBackward.apply(sp.x_AD, release)
    group, r = dispatcher.group, dispatcher.rank
    tables = chunk_tables(sp.table_PPW, degree)
    plans = [dispatcher.exchange_plan(t, sp.placement, x_TD.device) for t in tables]
    rows = [_send_rows(sp.table_PPW, r, degree, c).to(x_TD.device) for c in range(degree)]
    total = lambda field: tuple(map(sum, zip(*(getattr(p, field) for p in plans))))  # noqa: E731
    meta = EPDispatchMeta(sp.local, total("send_splits"), total("recv_splits"), None,
                          total("counts_L"), sp.placement)
    fetched = []   # replica weights, fetched once (first chunk) and shared by all chunks

    def extend(weights):
        if not fetched:
            fetched.append(dispatcher.expert_weights(weights, meta))
        return fetched[0]

    g_A = dispatcher.sent_gates(meta).view(-1, 1) if gated else None

    def issue(c):
        ex = plans[c]
        rows_c = _start(x_AD.index_select(0, rows[c]), ex.recv_splits, ex.send_splits, group,
                        f"dispatch {c}", timeline, wires[0])
        gates_c = None if g_A is None else _start(g_A.index_select(0, rows[c]), ex.recv_splits,
                                                  ex.send_splits, group, f"gates {c}", timeline)
        return rows_c, gates_c

    flying, extra = {0: issue(0)}, None
    if in_flight is not None:
        extra = _span(timeline, "shared experts", in_flight)
    returning = []
    for c in range(degree):
        if c + 1 < degree:
            flying[c + 1] = issue(c + 1)
        ex = plans[c]
        rows_c, gates_c = flying.pop(c)
        x_ND = _finish(rows_c, ex.recv_splits, ex.send_splits, group)
        perm, unperm = ex.perm_N.to(x_ND.device), ex.unperm_N.to(x_ND.device)
        g_N = None if gates_c is None else \
            permute_rows(_finish(gates_c, ex.recv_splits, ex.send_splits, group).view(-1), perm, unperm)
        y_ND = _span(timeline, f"experts {c}",
                     lambda: run_experts(permute_rows(x_ND, perm, unperm), list(ex.counts_L), extend,
                                         gate_N=g_N))
        returning.append(_start(permute_rows(y_ND, unperm, perm), ex.send_splits, ex.recv_splits, group,
                                f"combine {c}", timeline, wires[1]))
    if release is not None:
        release()
    y_parts = [_finish(returning[c], plans[c].send_splits, plans[c].recv_splits, group)
               for c in range(degree)]
    order_A = torch.cat(rows)
    inverse_A = torch.empty_like(order_A).scatter_(
        0, order_A, torch.arange(order_A.numel(), device=order_A.device))
    y_AD = permute_rows(torch.cat(y_parts), inverse_A, order_A) if degree > 1 else y_parts[0]
    return weighted_combine(y_AD, sp.local, out_dtype, not gated), meta, extra


def _span(timeline, name, fn):
    if timeline is None:
        return fn()
    with timeline.span("compute", name):
        return fn()
