"""Naive per-token reference of the MoE layer, written from the spec, not from moe/.

Shapes: T tokens, D model dim, E experts, K top-k, G routing groups, S tokens per group.
Everything is a Python loop over tokens and choices using plain torch ops on vectors, so
autograd through it gives reference gradients for the input, router and expert weights.
It reads the weights of a moe.MoELayer but none of its routing/dispatch code.
"""
import math

import torch
import torch.nn.functional as F

ACTS = {"gelu": (F.gelu, False), "relu": (F.relu, False), "swiglu": (F.silu, True)}


def clamped_swiglu_by_hand(gate_F, up_F, alpha, limit):
    """GPT-OSS: g = min(gate, limit), u = clamp(up, +-limit), (u + 1) * g * sigmoid(alpha g)."""
    g = torch.minimum(gate_F, torch.full_like(gate_F, limit))
    u = torch.maximum(torch.minimum(up_F, torch.full_like(up_F, limit)), torch.full_like(up_F, -limit))
    return (u + 1) * g / (1 + torch.exp(-alpha * g))


def expert_ffn(bank, e: int, x_D: torch.Tensor) -> torch.Tensor:
    """One expert on one token vector: act(x@w1 + b1) [* (x@w3 + b3)] @ w2 + b2."""
    h_F = x_D @ bank.w1[e] + (0 if bank.b1 is None else bank.b1[e])
    if bank.activation == "clamped_swiglu":
        up_F = x_D @ bank.w3[e] + (0 if bank.b3 is None else bank.b3[e])
        h_F = clamped_swiglu_by_hand(h_F, up_F, bank.act.alpha, bank.act.limit)
    else:
        act, gated = ACTS[bank.activation]
        h_F = act(h_F)
        if gated:
            h_F = h_F * (x_D @ bank.w3[e] + (0 if bank.b3 is None else bank.b3[e]))
    return h_F @ bank.w2[e] + (0 if bank.b2 is None else bank.b2[e])


def router_probs(layer, x_TD: torch.Tensor) -> tuple:
    """(logits, scores) per token: in at least fp32 (or the router's pinned dtypes);
    scores are softmax or an element-wise sigmoid of the logits (+ router bias)."""
    r = layer.router.config
    dt = r.logits_dtype or torch.promote_types(x_TD.dtype, torch.float32)
    logits_TE = x_TD.to(dt) @ layer.router.weight.to(dt).t()
    if layer.router.bias is not None:
        logits_TE = logits_TE + layer.router.bias.to(dt)
    z_TE = logits_TE.to(r.score_dtype or dt)
    if r.score_func == "sigmoid":
        return logits_TE, 1 / (1 + torch.exp(-z_TE))
    return logits_TE, torch.softmax(z_TE, dim=-1)


def eligible_experts(choice, E, n_group, topk_group):
    """Experts of the topk_group groups whose two best choice scores have the largest sum."""
    if n_group == 1:
        return list(range(E))
    M = E // n_group
    group_score = [sum(sorted(choice[g * M:(g + 1) * M], reverse=True)[:2]) for g in range(n_group)]
    kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    return [e for g in kept for e in range(g * M, (g + 1) * M)]


def token_choice_assignments(layer, probs_GSE, capacity_factor):
    """List of (g, s, k, e, gate) that survive capacity, plus per-group choices [G][S][K].

    Precedence: all first choices of the group (in token order), then all second choices...
    """
    G, S, E = probs_GSE.shape
    K, r = layer.top_k, layer.router.config
    bias_E = layer.router.selection_bias
    normalize = K > 1 if r.norm_topk_prob is None else r.norm_topk_prob
    choices = [[None] * S for _ in range(G)]
    for g in range(G):
        for s in range(S):
            scores = [float(probs_GSE[g, s, e].detach()) + float(bias_E[e]) for e in range(E)]
            pool = eligible_experts(scores, E, r.n_group, r.topk_group)
            ids = sorted(pool, key=lambda e: -scores[e])[:K]
            gates = [probs_GSE[g, s, e] for e in ids]
            if normalize:
                total = sum(gates)
                gates = [gt / total for gt in gates]
            gates = [gt * r.routed_scaling_factor for gt in gates]
            choices[g][s] = list(zip(ids, gates))
    kept = []
    for g in range(G):
        cap = None if capacity_factor is None else max(1, math.ceil(capacity_factor * S * K / E))
        cap = r.expert_capacity or cap
        used = [0] * E
        for k in range(K):
            for s in range(S):
                e, gate = choices[g][s][k]
                if cap is None or used[e] < cap:
                    used[e] += 1
                    kept.append((g, s, k, e, gate))
    return kept, choices


def expert_choice_assignments(layer, probs_GSE, capacity_factor):
    """Each expert keeps its top-C tokens of each group by probability: (g, s, e, gate)."""
    G, S, E = probs_GSE.shape
    cf = 1.0 if capacity_factor is None else capacity_factor
    C = min(S, max(1, math.ceil(cf * S * layer.top_k / E)))
    kept = []
    for g in range(G):
        for e in range(E):
            col = [float(probs_GSE[g, s, e].detach()) for s in range(S)]
            for s in sorted(range(S), key=lambda s: -col[s])[:C]:
                kept.append((g, s, e, probs_GSE[g, s, e] * layer.router.config.routed_scaling_factor))
    return kept


def reference_moe(layer, x: torch.Tensor, capacity_factor="layer"):
    """Returns (y like x, aux dict of unweighted losses, kept list, weighted aux_loss)."""
    if capacity_factor == "layer":
        capacity_factor = layer.capacity_factor if layer.training else layer.eval_capacity_factor
    D = x.shape[-1]
    S = x.shape[-2] if x.dim() >= 2 else 1
    x_GSD = x.reshape(-1, S, D)
    G = x_GSD.shape[0]
    E, K = layer.num_experts, layer.top_k
    logits_TE, probs_TE = router_probs(layer, x_GSD.reshape(-1, D))
    probs_GSE = probs_TE.reshape(G, S, E)
    rows = [[torch.zeros(D, dtype=probs_TE.dtype) for _ in range(S)] for _ in range(G)]
    aux = {"z_loss": (torch.logsumexp(logits_TE, -1) ** 2).mean()}
    if layer.router.config.kind == "expert_choice":
        kept = expert_choice_assignments(layer, probs_GSE, capacity_factor)
        for g, s, e, gate in kept:
            rows[g][s] = rows[g][s] + gate * expert_ffn(layer.experts, e, x_GSD[g, s]).to(gate.dtype)
    else:
        kept, choices = token_choice_assignments(layer, probs_GSE, capacity_factor)
        for g, s, k, e, gate in kept:
            rows[g][s] = rows[g][s] + gate * expert_ffn(layer.experts, e, x_GSD[g, s]).to(gate.dtype)
        P_GSE = probs_GSE
        if layer.router.config.score_func == "sigmoid":  # balance losses see scores summing to 1
            P_GSE = probs_GSE / probs_GSE.sum(-1, keepdim=True)
        aux["load_balance"] = load_balance_by_hand(P_GSE, choices)
    y_GSD = torch.stack([torch.stack(r) for r in rows]).to(x.dtype)
    if layer.shared_experts is not None:
        bank = layer.shared_experts.bank
        gate = layer.shared_experts.gate
        shared = [[expert_ffn(bank, 0, x_GSD[g, s]) for s in range(S)] for g in range(G)]
        if gate is not None:
            shared = [[torch.sigmoid(x_GSD[g, s] @ gate[0]) * shared[g][s] for s in range(S)]
                      for g in range(G)]
        y_GSD = y_GSD + torch.stack([torch.stack(r) for r in shared])
    coefs = {"load_balance": layer.aux_loss_coef, "z_loss": layer.z_loss_coef}
    aux_loss = sum(coefs[k] * v for k, v in aux.items())
    return y_GSD.reshape(x.shape), aux, kept, aux_loss


def load_balance_by_hand(probs_GSE, choices):
    """E * sum_e f_e * P_e per group, averaged over groups (f_e counts all S*K choices)."""
    G, S, E = probs_GSE.shape
    total = 0
    for g in range(G):
        picks = [e for s in range(S) for e, _ in choices[g][s]]
        for e in range(E):
            f_e = picks.count(e) / len(picks)
            P_e = sum(probs_GSE[g, s, e] for s in range(S)) / S
            total = total + E * f_e * P_e
    return total / G
