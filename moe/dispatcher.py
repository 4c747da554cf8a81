"""Local (one-process) dispatcher: sort token copies by expert, and undo it in combine.

Shapes: T tokens, D model dim, A assignments, N dispatched rows (N == A here), E experts.
`dispatch` returns an immutable `DispatchMeta` that `combine` consumes; nothing is kept on
the dispatcher between calls. No [T, E, C] one-hot tensors and no padding rows.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from .routing import Routing


@dataclass(frozen=True)
class DispatchMeta:
    token_N: torch.Tensor           # long [N]: source token row of each dispatched row
    gate_N: torch.Tensor            # fp32 [N]: its gate weight
    slot_N: Optional[torch.Tensor]  # long [N]: t*K + k (token choice) or None (index_add)
    slots_per_token: int
    num_tokens: int
    counts_E: tuple                 # rows per local expert, in order


def sort_by_expert(routing: Routing, num_experts: int):
    """Stable sort of the assignments by expert id -> (order_A, counts_E as python ints)."""
    order_A = torch.sort(routing.expert_A, stable=True).indices
    counts_E = torch.bincount(routing.expert_A, minlength=num_experts).tolist()
    return order_A, counts_E


def gather_sorted(x_TD: torch.Tensor, routing: Routing, order_A: torch.Tensor):
    token_N = routing.token_A[order_A]
    slot_N = None if routing.slot_A is None else routing.slot_A[order_A]
    return x_TD[token_N], token_N, routing.gate_A[order_A], slot_N


def weighted_combine(y_ND: torch.Tensor, meta: DispatchMeta, out_dtype) -> torch.Tensor:
    """Weight each row by its gate (fp32) and sum the copies of each token.

    Token choice places rows into a [T*K, D] buffer (dropped slots stay zero) and sums over K
    in a fixed order: bit-identical on every run and device. Expert choice uses index_add.
    """
    T, D = meta.num_tokens, y_ND.shape[-1]
    weighted_ND = y_ND.float() * meta.gate_N.unsqueeze(-1)
    if meta.slot_N is not None:
        K = meta.slots_per_token
        buf = weighted_ND.new_zeros(T * K, D)
        buf = buf.index_put((meta.slot_N,), weighted_ND)
        out_TD = buf.view(T, K, D).sum(dim=1)
    else:
        out_TD = weighted_ND.new_zeros(T, D).index_add(0, meta.token_N, weighted_ND)
    return out_TD.to(out_dtype)


class LocalDispatcher:
    """All experts live in this process."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD: torch.Tensor, routing: Routing):
        order_A, counts_E = sort_by_expert(routing, self.num_experts)
        x_ND, token_N, gate_N, slot_N = gather_sorted(x_TD, routing, order_A)
        meta = DispatchMeta(token_N, gate_N, slot_N, routing.slots_per_token,
                            routing.num_tokens, tuple(counts_E))
        return x_ND, list(counts_E), meta

    def combine(self, y_ND: torch.Tensor, meta: DispatchMeta, out_dtype) -> torch.Tensor:
        return weighted_combine(y_ND, meta, out_dtype)
