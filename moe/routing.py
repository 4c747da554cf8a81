"""The result of routing one batch: a flat list of (token, expert, gate) assignments.

Shapes: T tokens, E experts, K top-k, A assignments, G routing groups, S tokens per group.
Token-choice routing gives A <= T*K assignments with slot = t*K + k (the combine sums the K
slots of each token in a fixed order, deterministic on every device); expert-choice gives
A = groups*E*C assignments with no slots (combine sums each token's rows in expert order).
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Routing:
    token_A: torch.Tensor       # long [A]: token row of each assignment
    expert_A: torch.Tensor      # long [A]: global expert id
    gate_A: torch.Tensor        # fp32 [A]: gate weight (carries the router's gradient)
    slot_A: Optional[torch.Tensor]  # long [A]: t*K + k, or None for expert-choice
    slots_per_token: int        # K for token choice (0 for expert-choice)
    num_tokens: int             # T
    routed_E: torch.Tensor      # long [E]: assignments each expert was chosen for, before capacity
    z_loss: torch.Tensor        # scalar: the router z-loss of the logits (unweighted)
    entropy: torch.Tensor       # fp32 scalar: mean per-token entropy of router probabilities
    probs_GSE: Optional[torch.Tensor] = None  # scores as a distribution (balance-loss P), token choice
    ids_GSK: Optional[torch.Tensor] = None    # long: chosen experts before capacity, token choice

    @property
    def kept_E(self) -> torch.Tensor:
        return torch.bincount(self.expert_A, minlength=self.routed_E.numel())
