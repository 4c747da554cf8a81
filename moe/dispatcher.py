"""Local (one-process) dispatcher: sort token copies by expert, and undo it in combine.

Shapes: T tokens, D model dim, A assignments, N dispatched rows (N == A here), E experts.
`dispatch` returns an immutable `DispatchMeta` that `combine` consumes; nothing is kept on
the dispatcher between calls. No [T, E, C] one-hot tensors and no padding rows.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .routing import Routing
from .wire import round_trip


@dataclass(frozen=True)
class DispatchMeta:
    token_N: torch.Tensor           # long [N]: source token row of each dispatched row
    gate_N: torch.Tensor            # fp32 [N]: its gate weight
    slot_N: Optional[torch.Tensor]  # long [N]: t*K + k (token choice) or None (expert choice)
    slots_per_token: int
    num_tokens: int
    counts_E: torch.Tensor          # long [E]: rows per local expert, in order, on the device

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
    """Stable sort of the assignments by expert id -> (order_A, counts_E).

    counts_E: a long [E] tensor on the device (scatter_add: unlike bincount, it needs no
    host sync); the experts turn it into host ints only if their path needs them.
    """
    order_A = torch.sort(routing.expert_A, stable=True).indices
    expert_A = routing.expert_A
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_A.device)
    return order_A, counts_E.scatter_add_(0, expert_A, torch.ones_like(expert_A))


def gather_sorted(x_TD: torch.Tensor, routing: Routing, order_A: torch.Tensor):
    """Rows of x in expert order, with their source token, gate and slot.

    F.embedding rather than x_TD[token_N]: same forward gather, but its backward sums each
    token's K row gradients with a plain index_add, which measured clearly faster on CPU than
    advanced indexing's index_put(accumulate=True) backward (and is deterministic).
    """
    token_N = routing.token_A[order_A]
    slot_N = None if routing.slot_A is None else routing.slot_A[order_A]
    return F.embedding(token_N, x_TD), token_N, routing.gate_A[order_A], slot_N


def weighted_combine(y_ND: torch.Tensor, meta: DispatchMeta, out_dtype) -> torch.Tensor:
    """out[t] = sum over token t's kept rows of gate * y_row, in slot (k) order.

    One fused F.embedding_bag: bag t holds token t's rows (a dropped slot is simply absent),
    per-sample weights are the gates. It reads y once, allocates no [T*K, D] buffer and no
    fp32 copy of a bf16 y, and its backward is a gather for y (every row is used exactly
    once) and a row-dot for the gates, so it is deterministic. The gates are cast to y's
    dtype: in bf16 runs the weighting and the router's gate gradient have bf16 precision,
    like the expert outputs they multiply (the router itself stays fp32).
    """
    T, N, D = meta.num_tokens, y_ND.shape[0], y_ND.shape[-1]
    if N == 0 or T == 0:  # nothing kept: zeros that still belong to the graph
        return (y_ND.sum() * 0 + y_ND.new_zeros(T, D)).to(out_dtype)
    # token choice: slot t*K+k orders rows by (token, k); expert choice: by (token, expert)
    key_N = meta.slot_N if meta.slot_N is not None else meta.token_N
    bag_order_N = torch.sort(key_N, stable=True).indices
    counts_T = torch.bincount(meta.token_N, minlength=T)
    offsets_T = torch.cumsum(counts_T, 0) - counts_T
    if y_ND.is_cuda and y_ND.dtype == torch.bfloat16 and torch.is_grad_enabled():
        # CUDA has no bf16 kernel for the gates' gradient (per-sample-weights backward;
        # measured on an H200, torch 2.11): this case weighs in fp32 (one fp32 copy of y)
        y_ND = y_ND.float()
    gate_N = meta.gate_N[bag_order_N].to(y_ND.dtype)
    out_TD = F.embedding_bag(bag_order_N, y_ND, offsets_T, mode="sum", per_sample_weights=gate_N)
    return out_TD.to(out_dtype)


class LocalDispatcher:
    """All experts live in this process."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, wire=None, waiter=None):
        """-> (x_ND, counts_E, meta); counts_E a long [E] tensor on the device. wire: the
        exchange's format (moe/wire.py), applied here as the same rounding with no exchange;
        waiter: unused (nothing to wait for)."""
        order_A, counts_E = sort_by_expert(routing, self.num_experts)
        x_ND, token_N, gate_N, slot_N = gather_sorted(x_TD, routing, order_A)
        meta = DispatchMeta(token_N, gate_N, slot_N, routing.slots_per_token, routing.num_tokens,
                            counts_E)
        return round_trip(x_ND, wire), counts_E, meta

    def expert_weights(self, params: tuple, meta: DispatchMeta) -> tuple:
        """The weights of every expert slot: here just the experts (no replicas)."""
        return params

    def combine(self, y_ND: torch.Tensor, meta: DispatchMeta, out_dtype, wire=None,
                waiter=None) -> torch.Tensor:
        return weighted_combine(round_trip(y_ND, wire), meta, out_dtype)
