"""Expert capacity: which routing assignments are kept when experts have a size limit.

Shapes: G routing groups, S tokens per group, E experts, K top-k.
Precedence inside a group: every token's first choice before any second choice, and for the
same choice rank, earlier tokens before later ones (GShard/Switch order).
"""
import math

import torch


def expert_capacity(capacity_factor: float, tokens_per_group: int, top_k: int, num_experts: int) -> int:
    """Assignments an expert may take per routing group: ceil(cf * S * K / E)."""
    return max(1, math.ceil(capacity_factor * tokens_per_group * top_k / num_experts))


def capacity_keep_mask(ids_GSK: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Bool [G, S, K]: True where the assignment fits in its expert's capacity.

    Sorts the assignments of each group by expert with a stable sort over precedence order
    (choice rank major, token minor); an assignment's position inside its expert's run is its
    arrival order, kept iff < capacity. Costs one sort and one binary search, no [T, E, C]
    one-hot tensors and no host sync.
    """
    G, S, K = ids_GSK.shape
    ids_GA = ids_GSK.transpose(1, 2).reshape(G, K * S)  # precedence order: k major, s minor
    group_offset_G1 = torch.arange(G, device=ids_GSK.device).unsqueeze(1) * num_experts
    keys_A = (ids_GA + group_offset_G1).reshape(-1)
    sorted_A, order_A = torch.sort(keys_A, stable=True)
    run_start_A = torch.searchsorted(sorted_A, sorted_A)  # first position of each run
    pos_sorted_A = torch.arange(keys_A.numel(), device=keys_A.device) - run_start_A
    pos_A = torch.empty_like(pos_sorted_A).scatter_(0, order_A, pos_sorted_A)
    keep_GKS = (pos_A < capacity).reshape(G, K, S)
    return keep_GKS.transpose(1, 2).contiguous()


_DROPLESS_WORDS = ("none", "null", "dropless", "")


def check_capacity_factor(cf, name: str) -> None:
    """The one capacity-factor check: None (dropless) or a positive number."""
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
        raise ValueError(f"{name}={cf!r} must be a positive number, or None for dropless")


def parse_capacity_factor(value, name: str):
    """A config spelling -> None (dropless: None/0/"none"/"dropless") or a positive float."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _DROPLESS_WORDS):
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number; use a positive float "
                             f"(e.g. 1.25), or 0 / \"none\" for dropless") from None
    if value == 0 and not isinstance(value, bool):
        return None
    check_capacity_factor(value, name)
    return float(value)
