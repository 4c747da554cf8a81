"""Per-forward routing statistics, kept without autograd (cheap: a few [E] tensors).

E experts. Values stay on the layer's device until read, so recording them costs no sync.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingStats:
    routed_E: torch.Tensor   # assignments each expert was chosen for (before capacity)
    kept_E: torch.Tensor     # assignments each expert actually processed
    num_tokens: int
    top_k: int
    entropy: torch.Tensor    # mean per-token entropy of the router probabilities (nats)

    @property
    def dropped_fraction(self) -> float:
        routed = int(self.routed_E.sum())
        return 0.0 if routed == 0 else 1.0 - int(self.kept_E.sum()) / routed

    @property
    def imbalance(self) -> float:
        """max/mean of processed tokens per expert (1.0 = perfectly balanced)."""
        kept = self.kept_E.double()
        return 0.0 if kept.sum() == 0 else float(kept.max() / kept.mean())

    @property
    def dead_experts(self) -> list:
        return torch.nonzero(self.kept_E == 0).flatten().tolist()

    def as_dict(self) -> dict:
        return {
            "tokens": self.num_tokens, "top_k": self.top_k,
            "counts": self.kept_E.tolist(), "routed": self.routed_E.tolist(),
            "dropped_fraction": self.dropped_fraction, "imbalance": self.imbalance,
            "entropy": float(self.entropy), "dead_experts": self.dead_experts,
        }


def merge_stats(stats: list) -> RoutingStats:
    """Sum counts of several forwards (e.g. micro-batches) into one record."""
    n = sum(s.num_tokens for s in stats)
    return RoutingStats(
        routed_E=sum(s.routed_E for s in stats), kept_E=sum(s.kept_E for s in stats),
        num_tokens=n, top_k=stats[0].top_k,
        entropy=sum(s.entropy * s.num_tokens for s in stats) / max(n, 1),
    )
