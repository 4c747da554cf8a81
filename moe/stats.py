"""Per-forward routing statistics, kept without autograd (cheap: a few [E] tensors).

E experts, P ranks of the expert-parallel group (1 without expert parallelism). Values stay on the layer's device until read, so recording them costs no sync.
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RoutingStats:
    routed_E: torch.Tensor   # assignments each expert was chosen for (before capacity)
    kept_E: torch.Tensor     # assignments each expert actually processed
    num_tokens: int
    top_k: int
    entropy: torch.Tensor    # mean per-token entropy of the router probabilities (nats)
    # long [P]: rows each rank of the expert-parallel group received (after hot-expert
    # replication; the same on every rank of the group; one process: [1], all kept rows),
    # and what each would have received without replicas: None when no rank held a replica.
    rank_rows: Optional[torch.Tensor] = None
    rank_rows_unreplicated: Optional[torch.Tensor] = None

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
    def rank_imbalance(self) -> float:
        """max/mean of rows per expert-parallel rank (what the step waits for); 0 if unknown."""
        return _max_over_mean(self.rank_rows)

    @property
    def rank_imbalance_unreplicated(self) -> float:
        """rank_imbalance without the replicas (the same when there were none)."""
        return _max_over_mean(self.rank_rows if self.rank_rows_unreplicated is None
                              else self.rank_rows_unreplicated)

    @property
    def dead_experts(self) -> list:
        return torch.nonzero(self.kept_E == 0).flatten().tolist()

    def as_dict(self) -> dict:
        return {
            "tokens": self.num_tokens, "top_k": self.top_k,
            "counts": self.kept_E.tolist(), "routed": self.routed_E.tolist(),
            "dropped_fraction": self.dropped_fraction, "imbalance": self.imbalance,
            "entropy": float(self.entropy), "dead_experts": self.dead_experts,
            "rank_rows": None if self.rank_rows is None else self.rank_rows.tolist(),
            "rank_rows_unreplicated": (None if self.rank_rows_unreplicated is None
                                       else self.rank_rows_unreplicated.tolist()),
        }


def _max_over_mean(rows_P) -> float:
    if rows_P is None or rows_P.sum() == 0:
        return 0.0
    rows = rows_P.double()
    return float(rows.max() / rows.mean())


def _sum_or_none(ts: list):
    return None if any(t is None for t in ts) else sum(ts)


def merge_stats(stats: list) -> RoutingStats:
    """Sum counts of several forwards (e.g. micro-batches) into one record."""
    n = sum(s.num_tokens for s in stats)
    return RoutingStats(
        routed_E=sum(s.routed_E for s in stats), kept_E=sum(s.kept_E for s in stats),
        num_tokens=n, top_k=stats[0].top_k,
        entropy=sum(s.entropy * s.num_tokens for s in stats) / max(n, 1),
        rank_rows=_sum_or_none([s.rank_rows for s in stats]),
        rank_rows_unreplicated=_sum_or_none([s.rank_rows_unreplicated for s in stats]),
    )
