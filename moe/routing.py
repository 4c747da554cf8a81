"""The result of routing one batch: a flat list of (token, expert, gate) assignments.

Shapes: T tokens, E experts, K top-k, A assignments, G routing groups, S tokens per group.
Shapes are static, so nothing here needs the host to read the device. Token-choice routing
gives A = T*K assignments in slot order (slot = t*K + k); under a capacity limit a dropped
assignment keeps its slot with expert id E (past every real expert, so it sorts last) and
gate 0. Expert choice gives A = groups*E*C assignments with no slots (the combine sums each
token's rows in expert order).
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Routing:
    expert_A: torch.Tensor      # long [A]: global expert id (E: dropped over capacity)
    gate_A: torch.Tensor        # fp32 [A]: gate weight (carries the router's gradient)
    slots_per_token: int        # K for token choice (0 for expert-choice)
    num_tokens: int             # T
    routed_E: torch.Tensor      # long [E]: assignments each expert was chosen for, before capacity
    kept_E: torch.Tensor        # long [E]: assignments each expert processes (after capacity)
    z_loss: torch.Tensor        # scalar: the router z-loss of the logits (unweighted)
    entropy: torch.Tensor       # fp32 scalar: mean per-token entropy of router probabilities
    probs_GSE: Optional[torch.Tensor] = None  # scores as a distribution (balance-loss P), token choice
    ids_GSK: Optional[torch.Tensor] = None    # long: chosen experts before capacity, token choice
    dropped: bool = False       # whether any assignment can be dropped (a capacity limit)
    fan_in_tokens_A: Optional[torch.Tensor] = None  # long [A]: expert choice's token rows
    routed_GE: Optional[torch.Tensor] = None  # long [G, E]: routed_E per routing group (token choice)

    @property
    def slot_A(self) -> Optional[torch.Tensor]:
        """long [A]: t*K + k of each assignment (token choice), None for expert choice."""
        if self.fan_in_tokens_A is not None:
            return None
        return torch.arange(self.expert_A.numel(), device=self.expert_A.device)

    @property
    def token_A(self) -> torch.Tensor:
        """long [A]: the token row of each assignment."""
        if self.fan_in_tokens_A is not None:
            return self.fan_in_tokens_A
        return torch.div(self.slot_A, self.slots_per_token, rounding_mode="floor")


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """long [n]: how often each of 0..n-1 occurs in ids (values in 0..n; n, a dropped
    assignment, is not counted). A scatter
    on the device: unlike bincount, the host never waits for it."""
    counts = torch.zeros(n + 1, dtype=torch.long, device=ids.device)
    return counts.scatter_add_(0, ids.reshape(-1), ids.new_ones(()).expand(ids.numel()))[:n]


def count_per_group(ids_GSK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """long [G, E]: how often each expert occurs in each routing group's ids (one scatter)."""
    G, E = ids_GSK.shape[0], num_experts
    ids_GA = ids_GSK.reshape(G, -1)
    if G > 1:
        ids_GA = ids_GA + torch.arange(0, G * E, E, device=ids_GA.device).unsqueeze(1)
    return count_ids(ids_GA, G * E).view(G, E)


def recomputing() -> bool:
    """True inside an autograd backward pass: where activation checkpointing runs a forward
    again. Counters a forward adds to (routed loads, the balance window) must not count it
    twice; what the forward used must be used again."""
    if torch.compiler.is_compiling():  # a compiled region's recompute is the compiler's
        return False
    return torch._C._current_graph_task_id() != -1
