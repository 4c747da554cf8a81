"""Router auxiliary losses: the load-balance loss in all its variants (and its window), and
the router z-loss. The one home of both; the router never computes the balance loss.

Shapes: G routing groups (sequences), S tokens per group, E experts, K top-k.
Every balance variant is E * sum_e f_e * P_e (Switch), f_e = share of the K-per-token routing
assignments that chose e (before capacity drops, no gradient), P_e = mean balance probability
of e (moe/scoring.py: softmax, or sigmoid scores normalised per token). With perfectly
uniform routing the loss is 1.0; it grows as load concentrates. The variants differ in which
tokens f and P are averaged over:
  sequence      f and P per routing group, loss averaged over groups (the default). With
                score_func="sigmoid" this is DeepSeek-V3's sequence-wise balance loss.
  micro_batch   f and P over every token of the forward, on all ranks of the balance group.
  global_batch  P over this forward's tokens (all ranks), f over every token routed since
                the last `reset_window()`: all micro-batches of the step so far, on all ranks
                of the balance group (Qwen's global-batch balancing). The window is reset
                explicitly at each optimizer step.
Masked-out tokens (token_mask False, e.g. padding) count in neither f nor P.

Layout invariance. The balance group is the set of data-parallel ranks whose gradients are
averaged. Rank r returns world * E * sum_e f_e * Psum_e(r) / T, with f and the token count
T all-reduced (no gradient) and Psum_e(r) its own tokens' probability sum: the mean over
ranks of the value is the one-process loss, and so is the mean of the gradients. The
sequence variant all-reduces only the number of sequences (none without a balance group);
without a mask and a group it needs no communication at all: every data-parallel rank holds
the same number of sequences, so the dp mean of the local means is the global mean.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from .config import BALANCE_LOSSES
from .routing import count_per_group, recomputing

MAX_WINDOW_SNAPSHOTS = 4096  # forwards per window whose f a recompute may ask for again

__all__ = ["BalanceLoss", "BALANCE_LOSSES", "load_balance_loss", "router_z_loss"]


def router_z_loss(logits_GSE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (keeps logits small)."""
    return torch.logsumexp(logits_GSE, dim=-1).square().mean()


def load_balance_loss(probs_GSE: torch.Tensor, ids_GSK: torch.Tensor, counts_GE=None) -> torch.Tensor:
    """The sequence variant without mask or group: per group E * sum_e f_e * P_e, mean over
    groups (one scatter for the counts, one dot product for the sum). counts_GE: the routing's
    assignments per group and expert, when it has them (moe/routing.py routed_GE)."""
    G, S, E = probs_GSE.shape
    K = ids_GSK.shape[-1]
    with torch.no_grad():
        counts_GE = count_per_group(ids_GSK, E) if counts_GE is None else counts_GE
        counts_GE = counts_GE.reshape(-1).to(probs_GSE.dtype)
    mean_prob_GE = probs_GSE.mean(dim=1).reshape(-1)
    return torch.dot(counts_GE, mean_prob_GE) * (E / (S * K * G))


def _weights_GS(probs_GSE, mask_GS):
    if mask_GS is None:
        return torch.ones(probs_GSE.shape[:2], dtype=probs_GSE.dtype, device=probs_GSE.device)
    return mask_GS.to(probs_GSE.dtype)


def sequence_balance_loss(probs_GSE, ids_GSK, mask_GS=None, group=None, seq_group=None,
                          counts_GE=None) -> torch.Tensor:
    """Per routing group, averaged over groups that hold at least one unmasked token.

    With a mask and a balance group, the average runs over the groups of all its ranks
    (world * local sum / global count), so ranks holding different numbers of unpadded
    sequences still average to the one-process loss. Without a mask every rank holds the
    same number of sequences: the local mean is exact and nothing is communicated.
    With a sequence group (context parallelism: each rank holds part of every sequence)
    the per-sequence counts are summed over it and each rank returns cp x its part of each
    sequence's loss, so the mean over the ranks is the one-process loss (and gradient).
    """
    if mask_GS is None and seq_group is None:
        return load_balance_loss(probs_GSE, ids_GSK, counts_GE)
    total, n_valid = sequence_terms(probs_GSE, ids_GSK, mask_GS, seq_group)
    if mask_GS is None:
        return total / probs_GSE.shape[0]
    stats, world = all_reduce_stats(n_valid.reshape(1), group)
    n = int(stats[0])
    return total * 0 if n == 0 else world * total / n


def sequence_terms(probs_GSE, ids_GSK, mask_GS=None, seq_group=None):
    """(sum over groups with an unmasked token of their loss, number of such groups, long).
    With seq_group (a group or a tuple of groups), counts and token numbers are the whole
    sequence's (summed over it) and each group's term is the number of ranks holding parts
    x this rank's part (see sequence_balance_loss)."""
    G, S, E = probs_GSE.shape
    K = ids_GSK.shape[-1]
    w_GS = _weights_GS(probs_GSE, mask_GS)
    with torch.no_grad():
        counts_GE = torch.zeros(G, E, dtype=probs_GSE.dtype, device=probs_GSE.device)
        counts_GE.scatter_add_(1, ids_GSK.reshape(G, S * K),
                               w_GS.unsqueeze(-1).expand(G, S, K).reshape(G, S * K))
    tokens_G = w_GS.sum(dim=1)
    parts = 1
    groups = seq_group if isinstance(seq_group, tuple) else (seq_group,)
    if seq_group is not None:
        with torch.no_grad():
            both = torch.cat([counts_GE, tokens_G.detach().unsqueeze(-1)], dim=-1)
            for group in groups:  # cp, then tp: each sums over its ranks' parts
                dist.all_reduce(both, group=group)
                parts *= dist.get_world_size(group)
            counts_GE, tokens_G = both[:, :E], both[:, E]
    valid_G = tokens_G > 0
    psum_GE = (probs_GSE * w_GS.unsqueeze(-1)).sum(dim=1)
    n_G = tokens_G.clamp_min(1).unsqueeze(-1)
    per_G = parts * E * (counts_GE / (K * n_G) * psum_GE / n_G).sum(dim=-1)
    return (per_G * valid_G).sum(), valid_G.sum()


def local_terms(probs_GSE, ids_GSK, mask_GS=None):
    """(stats [E+1] long: per-expert assignments and the token count, no grad; psum_E)."""
    G, S, E = probs_GSE.shape
    K = ids_GSK.shape[-1]
    w_GS = _weights_GS(probs_GSE, mask_GS)
    psum_E = (probs_GSE * w_GS.unsqueeze(-1)).sum(dim=(0, 1))
    with torch.no_grad():
        keep_A = w_GS.unsqueeze(-1).expand(G, S, K).reshape(-1) > 0
        counts_E = torch.bincount(ids_GSK.reshape(-1)[keep_A], minlength=E)
        tokens = (w_GS > 0).sum().reshape(1)
    return torch.cat([counts_E, tokens.to(counts_E.dtype)]), psum_E


def all_reduce_stats(stats, group) -> tuple:
    """Sum the [E+1] stats over the balance group -> (summed stats, group size)."""
    if group is None:
        return stats, 1
    stats = stats.clone()
    dist.all_reduce(stats, group=group)
    return stats, dist.get_world_size(group)


def pooled_balance_loss(psum_E, f_stats, tokens_now: int, world: int, top_k: int):
    """world * E * sum_e f_e * psum_e / tokens_now, f_e = counts_e / (K * tokens) of f_stats."""
    E = psum_E.shape[0]
    counts_E, tokens = f_stats[:-1].to(psum_E.dtype), float(f_stats[-1])
    if tokens == 0 or tokens_now == 0:
        return psum_E.sum() * 0
    f_E = counts_E / (top_k * tokens)
    return world * E * (f_E * psum_E).sum() / tokens_now


class BalanceLoss(nn.Module):
    """The load-balance loss of one MoE layer: its variant, its balance group and its
    global_batch window (assignments per expert and the token count since `reset_window()`,
    a non-persistent buffer [E+1])."""

    def __init__(self, variant: str, num_experts: int, top_k: int):
        super().__init__()
        self.variant, self.top_k = variant, top_k
        self.group = None       # ranks whose tokens micro_batch/global_batch pool (and the
                                # masked sequence variant counts sequences over)
        self.seq_group = None   # ranks holding parts of the same sequences (context parallel)
        self.register_buffer("window", torch.zeros(num_experts + 1, dtype=torch.long),
                             persistent=False)
        self.seen = []  # f of each forward since reset_window, for their recomputes

    def reset_window(self) -> None:
        self.window.zero_()
        self.seen = []

    def _window_f(self, stats):
        """The window's f for this forward: the window with this forward's stats added, or,
        when activation checkpointing recomputes a forward, the f that forward used (forwards
        and their recomputes come in the same order, also under parallel.a2a_overlap=1f1b)."""
        if recomputing() and self.seen:
            return self.seen.pop(0)
        self.window += stats.to(self.window.device)
        f_stats = self.window.clone()
        if torch.is_grad_enabled():
            self.seen = (self.seen + [f_stats])[-MAX_WINDOW_SNAPSHOTS:]
        return f_stats

    def forward(self, probs_GSE, ids_GSK, mask_GS=None, counts_GE=None) -> torch.Tensor:
        """counts_GE: the routing's assignments per (group, expert) when known (saves a count)."""
        if self.variant == "sequence":
            return sequence_balance_loss(probs_GSE, ids_GSK, mask_GS, self.group, self.seq_group,
                                         counts_GE)
        stats, psum_E = local_terms(probs_GSE, ids_GSK, mask_GS)
        stats, world = all_reduce_stats(stats, self.group)
        f_stats = stats
        if self.variant == "global_batch" and self.training:
            f_stats = self._window_f(stats)
        return pooled_balance_loss(psum_E, f_stats, int(stats[-1]), world, self.top_k)
