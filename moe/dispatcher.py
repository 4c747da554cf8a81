"""Local (one-process) dispatcher: gather token copies in expert order, and undo it in combine.

Shapes: T tokens, D model dim, A assignments, N dispatched rows (N == A here), E experts,
K slots per token (top-k).
`dispatch` returns an immutable `DispatchMeta` that `combine` consumes; nothing is kept on
the dispatcher between calls. No [T, E, C] one-hot tensors, no host sync, static shapes:
under a capacity limit the dropped assignments sort last (expert id E) and are carried as
rows the experts leave at zero.

Both permutations are gathers whose backward is a gather by the inverse permutation, known
from the forward (never a sort-based backward): token choice's slots t*K+k are a permutation
of the A rows. Expert choice picks tokens per expert, so its rows fan in: there the backward
of the dispatch, and the combine, are one index_add.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .experts import pad_rows
from .routing import Routing
from .wire import round_trip


@dataclass(frozen=True)
class DispatchMeta:
    token_N: torch.Tensor           # long [N]: source token row of each dispatched row
    gate_rows: Optional[torch.Tensor]  # fp32 [N]: its gate weight (None: taken from gate_A)
    slot_N: Optional[torch.Tensor]  # long [N]: t*K + k (token choice) or None (rows fan in)
    slots_per_token: int
    num_tokens: int
    counts_E: torch.Tensor          # long [E]: rows per local expert, in order, on the device
    row_A: Optional[torch.Tensor] = None   # long [A = T*K]: the row of slot t*K+k (token choice)
    gate_A: Optional[torch.Tensor] = None  # fp32 [A]: the gates in slot order (token choice)
    padded: bool = False            # rows past sum(counts_E) are dropped assignments
    bag_T: Optional[torch.Tensor] = None  # long [T]: t*K, where token t's K slots start

    @property
    def gate_N(self) -> torch.Tensor:
        """fp32 [N]: each row's gate (token choice: gathered from the slot order on demand)."""
        return self.gate_A[self.slot_N] if self.gate_rows is None else self.gate_rows

    @property
    def rank_rows(self) -> torch.Tensor:
        """long [1]: rows this process's experts received (one rank: all kept rows); stays on
        the device (no sync)."""
        return self.counts_E.sum().reshape(1)

    @property
    def rank_rows_unreplicated(self):
        """None: one process has no replicas (see EPDispatchMeta)."""
        return None


def sort_by_expert(routing: Routing, num_experts: int):
    """Stable sort of the assignments by expert id -> (order_A, counts_E): dropped assignments
    (id E) last; counts_E the routing's kept counts, a long [E] on the device."""
    return torch.argsort(routing.expert_A, stable=True), routing.kept_E


def sorted_meta(routing: Routing, order_A: torch.Tensor, counts_E) -> DispatchMeta:
    """The DispatchMeta of the assignments taken in `order_A` (a permutation of all A)."""
    if routing.fan_in_tokens_A is not None:  # expert choice: rows fan in
        return DispatchMeta(routing.token_A[order_A], routing.gate_A[order_A], None, 0,
                            routing.num_tokens, counts_E, padded=routing.dropped)
    K = routing.slots_per_token
    row_A = torch.empty_like(order_A).scatter_(
        0, order_A, torch.arange(order_A.numel(), device=order_A.device))
    bag_T = torch.arange(0, order_A.numel(), K, device=order_A.device)
    return DispatchMeta(torch.div(order_A, K, rounding_mode="floor"), None, order_A, K,
                        routing.num_tokens, counts_E, row_A, routing.gate_A, routing.dropped, bag_T)


class _GatherRows(torch.autograd.Function):
    """rows = x_TD[token_N]; backward sums each token's row gradients: over its K slots by
    their known rows (one embedding_bag, a gather-and-sum), or one index_add (fan-in)."""

    @staticmethod
    def forward(ctx, x_TD, meta):
        ctx.meta, ctx.T = meta, x_TD.shape[0]
        return x_TD.index_select(0, meta.token_N)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_ND):
        meta, T = ctx.meta, ctx.T
        if meta.row_A is None:
            return g_ND.new_zeros(T, g_ND.shape[-1]).index_add_(0, meta.token_N, g_ND), None
        return F.embedding_bag(meta.row_A, g_ND, meta.bag_T, mode="sum"), None


class _WeightedBags(torch.autograd.Function):
    """out[t] = sum_k gate_A[t*K+k] * y_ND[row_A[t*K+k]]: one embedding_bag forward (a fixed
    summation order per token, whatever the batch or thread count: layouts that split the
    tokens agree bit for bit). Backward by gathers with the known rows, no sort: each row's
    gradient is its gate times its token's output gradient, each gate's the dot product of its
    row with that gradient (a batched matmul)."""

    @staticmethod
    def forward(ctx, y_ND, gate_A, meta):
        ctx.meta, ctx.gate_dtype = meta, gate_A.dtype
        gate_A = gate_A.to(y_ND.dtype)
        ctx.save_for_backward(y_ND, gate_A)
        return F.embedding_bag(meta.row_A, y_ND, meta.bag_T, mode="sum", per_sample_weights=gate_A)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_TD):
        y_ND, gate_A = ctx.saved_tensors
        meta = ctx.meta
        g_ND = g_TD.index_select(0, meta.token_N)
        dy_ND = g_ND * gate_A.index_select(0, meta.slot_N).unsqueeze(-1)
        dgate_N = torch.bmm(y_ND.unsqueeze(1), g_ND.unsqueeze(2)).view(-1)
        return dy_ND, dgate_N.index_select(0, meta.row_A).to(ctx.gate_dtype), None


class _SumBags(torch.autograd.Function):
    """out[t] = sum_k y_ND[row_A[t*K+k]] (the gates already applied inside the experts:
    moe/row_gates.py): one embedding_bag; keeps nothing but the known rows, and its backward
    hands each row its token's output gradient (one gather)."""

    @staticmethod
    def forward(ctx, y_ND, meta):
        ctx.meta = meta
        return F.embedding_bag(meta.row_A, y_ND, meta.bag_T, mode="sum")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_TD):
        return g_TD.index_select(0, ctx.meta.token_N), None


class _PermuteRows(torch.autograd.Function):
    """out = x[index], index a permutation whose inverse is known: backward gathers by it."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation `index` with inverse `inverse` (no sort-based backward)."""
    return _PermuteRows.apply(x, index, inverse)


def gather_sorted(x_TD: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
    """x's rows in the order of meta (expert order): one gather."""
    return _GatherRows.apply(x_TD, meta)


def row_gates(meta: DispatchMeta) -> torch.Tensor:
    """fp32 [N]: the gate of each dispatched row, in row order (expert order), differentiable
    into the router's gates: token choice by a permutation whose inverse is known (a gather
    backward, no sort), fan-in rows as the meta holds them."""
    if meta.row_A is None:
        return meta.gate_rows
    return permute_rows(meta.gate_A, meta.slot_N, meta.row_A)


def weighted_combine(y_ND: torch.Tensor, meta: DispatchMeta, out_dtype,
                     weighted: bool = True) -> torch.Tensor:
    """out[t] = sum over token t's kept rows of gate * y_row.

    Token choice: one weighted embedding_bag over each token's K rows (their places are known,
    no sort), with a gather-based backward (_WeightedBags); dropped slots have gate 0 and a
    zero row. y may have fewer rows than slots (an exchange returns
    only the kept ones, which come first): zero rows stand in for the rest. Rows that fan in
    (expert choice, the hierarchical proxies): one index_add of gate * y. The gates are cast
    to y's dtype; no fp32 copy of y is made. weighted=False: the rows already carry their
    gates (moe.gates_in_experts, moe/row_gates.py): a plain sum, nothing kept for backward.
    """
    T, D = meta.num_tokens, y_ND.shape[-1]
    if meta.row_A is None:
        w_ND = y_ND * meta.gate_N.to(y_ND.dtype).unsqueeze(-1) if weighted else y_ND
        return y_ND.new_zeros(T, D).index_add_(0, meta.token_N, w_ND).to(out_dtype)
    y_AD = pad_rows(y_ND, meta.row_A.numel())
    out = _WeightedBags.apply(y_AD, meta.gate_A, meta) if weighted else _SumBags.apply(y_AD, meta)
    return out.to(out_dtype)


class LocalDispatcher:
    """All experts live in this process."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, wire=None, waiter=None):
        """-> (x_ND, counts_E, meta); counts_E a long [E] tensor on the device. wire: the
        exchange's format (moe/wire.py), applied here as the same rounding with no exchange;
        waiter: unused (nothing to wait for)."""
        order_A, counts_E = sort_by_expert(routing, self.num_experts)
        meta = sorted_meta(routing, order_A, counts_E)
        return round_trip(gather_sorted(x_TD, meta), wire), counts_E, meta

    def expert_weights(self, params: tuple, meta: DispatchMeta) -> tuple:
        """The weights of every expert slot: here just the experts (no replicas)."""
        return params

    def gates(self, meta: DispatchMeta, waiter=None) -> torch.Tensor:
        """fp32 [N]: each dispatched row's gate, in the rows' order (moe.gates_in_experts)."""
        return row_gates(meta)

    def combine(self, y_ND: torch.Tensor, meta: DispatchMeta, out_dtype, wire=None,
                waiter=None, weighted: bool = True) -> torch.Tensor:
        return weighted_combine(round_trip(y_ND, wire), meta, out_dtype, weighted)
