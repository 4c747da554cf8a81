"""Router auxiliary losses, as pure functions of one forward's routing.

Shapes: G routing groups, S tokens per group, E experts, K top-k.
Both losses are computed per routing group and averaged over groups, so a parallel layout
that keeps groups (sequences) whole computes exactly the same value.
"""
import torch


def load_balance_loss(probs_GSE: torch.Tensor, ids_GSK: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, E * sum_e f_e * P_e, mean over groups.

    f_e: share of the group's S*K routing assignments that chose expert e (before capacity
    drops; no gradient). P_e: mean router probability of expert e over the group's tokens.
    With perfectly uniform routing the loss is 1.0; it grows as load concentrates.
    """
    G, S, E = probs_GSE.shape
    K = ids_GSK.shape[-1]
    with torch.no_grad():
        counts_GE = torch.zeros(G, E, device=probs_GSE.device, dtype=probs_GSE.dtype)
        counts_GE.scatter_add_(1, ids_GSK.reshape(G, S * K), torch.ones_like(ids_GSK, dtype=probs_GSE.dtype).reshape(G, S * K))
        frac_GE = counts_GE / (S * K)
    mean_prob_GE = probs_GSE.mean(dim=1)
    return E * (frac_GE * mean_prob_GE).sum(dim=-1).mean()


def router_z_loss(logits_GSE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (keeps logits small)."""
    return torch.logsumexp(logits_GSE, dim=-1).square().mean()
