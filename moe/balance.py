"""Load-balance loss variants: per sequence, per micro-batch, per global batch.

Shapes: G routing groups (sequences), S tokens per group, E experts, K top-k.
All are E * sum_e f_e * P_e (Switch), f_e = share of the K-per-token routing assignments
that chose e (no gradient), P_e = mean balance probability of e (moe/scoring.py:
softmax, or sigmoid scores normalised per token). They differ in which tokens f and P are
averaged over:
  sequence      f and P per routing group, loss averaged over groups (the default). With
                score_func="sigmoid" this is DeepSeek-V3's sequence-wise balance loss.
  micro_batch   f and P over every token of the forward, on all ranks of the balance group.
  global_batch  P over this forward's tokens (all ranks), f over every token routed since
                the last `reset_balance_window()`: all micro-batches of the step so far, on
                all ranks of the balance group (Qwen's global-batch balancing). The window is
                reset explicitly at each optimizer step.
Masked-out tokens (token_mask False, e.g. padding) count in neither f nor P.

Layout invariance. The balance group is the set of data-parallel ranks whose gradients are
averaged. Rank r returns world * E * sum_e f_e * Psum_e(r) / T, with f and the token count
T all-reduced (no gradient) and Psum_e(r) its own tokens' probability sum: the mean over
ranks of the value is the one-process loss, and so is the mean of the gradients. The
sequence variant all-reduces only the number of sequences (none without a balance group).
"""
import torch
import torch.distributed as dist

from .losses import load_balance_loss

BALANCE_LOSSES = ("sequence", "micro_batch", "global_batch")


def _weights_GS(probs_GSE, mask_GS):
    if mask_GS is None:
        return torch.ones(probs_GSE.shape[:2], dtype=probs_GSE.dtype, device=probs_GSE.device)
    return mask_GS.to(probs_GSE.dtype)


def sequence_balance_loss(probs_GSE, ids_GSK, mask_GS=None, group=None) -> torch.Tensor:
    """Per routing group, averaged over groups that hold at least one unmasked token.

    With a balance group, the average runs over the groups of all its ranks (world * local
    sum / global count), so ranks holding different numbers of (unpadded) sequences still
    average to the one-process loss.
    """
    if mask_GS is None and group is None:
        return load_balance_loss(probs_GSE, ids_GSK)
    total, n_valid = sequence_terms(probs_GSE, ids_GSK, mask_GS)
    stats, world = all_reduce_stats(n_valid.reshape(1), group)
    n = int(stats[0])
    return total * 0 if n == 0 else world * total / n


def sequence_terms(probs_GSE, ids_GSK, mask_GS=None):
    """(sum over groups with an unmasked token of their loss, number of such groups, long)."""
    G, S, E = probs_GSE.shape
    K = ids_GSK.shape[-1]
    w_GS = _weights_GS(probs_GSE, mask_GS)
    with torch.no_grad():
        counts_GE = torch.zeros(G, E, dtype=probs_GSE.dtype, device=probs_GSE.device)
        counts_GE.scatter_add_(1, ids_GSK.reshape(G, S * K),
                               w_GS.unsqueeze(-1).expand(G, S, K).reshape(G, S * K))
    tokens_G = w_GS.sum(dim=1)
    valid_G = tokens_G > 0
    psum_GE = (probs_GSE * w_GS.unsqueeze(-1)).sum(dim=1)
    n_G = tokens_G.clamp_min(1).unsqueeze(-1)
    per_G = E * (counts_GE / (K * n_G) * psum_GE / n_G).sum(dim=-1)
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


def check_balance_loss(balance_loss: str, router: str) -> None:
    if balance_loss not in BALANCE_LOSSES:
        raise ValueError(f"balance_loss={balance_loss!r} is not supported; use one of {BALANCE_LOSSES}")
    if router == "expert_choice" and balance_loss != "sequence":
        raise ValueError(f"balance_loss={balance_loss!r} needs token-choice routing; "
                         f"router='expert_choice' is balanced by construction and has no balance loss")
