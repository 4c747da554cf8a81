"""Routers: token-choice top-k (Switch k=1, GShard/Mixtral k>=2, DeepSeek-V3) and expert-choice.

Shapes: T tokens, D model dim, E experts, K top-k, G routing groups, S tokens per group,
C expert capacity per group, A assignments.
Logits and scores are fp32 for fp32/bf16/fp16 inputs (fp64 inputs stay fp64, so a float64
reference run is exact), whatever the parameter dtype, unless `logits_dtype`/`score_dtype`
pin them (to reproduce checkpoints whose routers compute in fp32 even in an fp64 run).
The scoring and selection steps themselves are pure functions in moe/scoring.py.
"""
import torch
import torch.nn as nn

from .capacity import capacity_keep_mask, expert_capacity
from .losses import load_balance_loss, router_z_loss
from .routing import Routing
from .scoring import balance_probs, gates_for, scores_from_logits, select_experts

ROUTER_KINDS = ("token_choice", "expert_choice")


def as_dtype(value, name: str):
    """None, a torch.dtype, or its name ("float32") -> torch.dtype or None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"{name}={value!r} is not a floating dtype; use e.g. 'float32' or None")
    return dt


class Router(nn.Module):
    """Linear router with optional bias, jitter, aux-loss-free selection bias and capacity.

    `weight` is [E, D]; logits = x @ weight.T (+ `bias` [E] if router_bias). `selection_bias`
    ([E], no gradient) is added to the scores only when choosing experts (DeepSeek-V3
    aux-loss-free balancing), for softmax and sigmoid scores alike; gate values always come
    from the unbiased scores. The bias is moved by an explicit `update_selection_bias` call,
    never inside forward. See moe/scoring.py for score_func, norm_topk_prob, n_group,
    topk_group and routed_scaling_factor.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, kind: str = "token_choice",
                 jitter: float = 0.0, init_std: float = 0.02, *, score_func: str = "softmax",
                 norm_topk_prob=None, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, router_bias: bool = False,
                 logits_dtype=None, score_dtype=None, expert_capacity=None,
                 force_balance: bool = False):
        super().__init__()
        self.force_balance = bool(force_balance)
        self.num_experts, self.top_k, self.kind = num_experts, top_k, kind
        self.jitter, self.init_std = jitter, init_std
        self.score_func = score_func
        self.norm_topk_prob = top_k > 1 if norm_topk_prob is None else bool(norm_topk_prob)
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.logits_dtype = as_dtype(logits_dtype, "logits_dtype")
        self.score_dtype = as_dtype(score_dtype, "score_dtype")
        self.expert_capacity = expert_capacity
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.bias = nn.Parameter(torch.empty(num_experts)) if router_bias else None
        self.register_buffer("selection_bias", torch.zeros(num_experts, dtype=torch.float32))
        # routed-assignment counts accumulated since the last bias update (training only)
        self.register_buffer("pending_load", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        dtype = self.logits_dtype or torch.promote_types(x_TD.dtype, torch.float32)
        x32_TD = x_TD.to(dtype)
        if self.training and self.jitter > 0:
            noise = torch.empty_like(x32_TD).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            x32_TD = x32_TD * noise
        logits_TE = x32_TD @ self.weight.to(dtype).t()
        return logits_TE if self.bias is None else logits_TE + self.bias.to(dtype)

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """softmax/sigmoid of the logits, in score_dtype when set (else the logits' dtype)."""
        return scores_from_logits(logits_TE.to(self.score_dtype or logits_TE.dtype), self.score_func)

    def forward(self, x_GSD: torch.Tensor, capacity_factor) -> Routing:
        G, S, D = x_GSD.shape
        logits_GSE = self.logits(x_GSD.reshape(G * S, D)).reshape(G, S, self.num_experts)
        scores_GSE = self.scores(logits_GSE)
        if self.kind == "expert_choice":
            routing = self._expert_choice(scores_GSE, capacity_factor)
        else:
            routing = self._token_choice(scores_GSE, capacity_factor)
        routing.aux_losses["z_loss"] = router_z_loss(logits_GSE)
        if self.training:
            self.pending_load += routing.routed_E.to(self.pending_load.dtype)
        return routing

    def _capacity(self, capacity_factor, S: int):
        """Assignments each expert may take per group, or None (dropless)."""
        if self.expert_capacity is not None:
            return self.expert_capacity
        if capacity_factor is None:
            return None
        return expert_capacity(capacity_factor, S, self.top_k, self.num_experts)

    def _token_choice(self, scores_GSE, capacity_factor) -> Routing:
        G, S, E = scores_GSE.shape
        K, T = self.top_k, G * S
        scores_TE = scores_GSE.reshape(T, E)
        ids_TK = select_experts(scores_TE, self.selection_bias, K, self.n_group, self.topk_group)
        gates_TK = gates_for(scores_TE, ids_TK, self.norm_topk_prob, self.routed_scaling_factor)
        if self.force_balance:  # benchmarking: same gates, experts dealt round-robin
            ids_TK = forced_balanced_ids(T, K, E, scores_GSE.device)
        ids_GSK = ids_TK.reshape(G, S, K)
        slot_A = torch.arange(T * K, device=scores_GSE.device)
        capacity = self._capacity(capacity_factor, S)
        if capacity is not None:
            keep_GSK = capacity_keep_mask(ids_GSK, E, capacity)
            slot_A = slot_A[keep_GSK.reshape(-1)]
        probs_GSE = balance_probs(scores_GSE, self.score_func)
        return Routing(
            token_A=torch.div(slot_A, K, rounding_mode="floor"),
            expert_A=ids_TK.reshape(-1)[slot_A],
            gate_A=gates_TK.reshape(-1)[slot_A],
            slot_A=slot_A, slots_per_token=K, num_tokens=T,
            routed_E=torch.bincount(ids_TK.reshape(-1), minlength=E),
            aux_losses={"load_balance": load_balance_loss(probs_GSE, ids_GSK)},
            entropy=_entropy(probs_GSE),
            probs_GSE=probs_GSE, ids_GSK=ids_GSK,
        )

    def _expert_choice(self, scores_GSE, capacity_factor) -> Routing:
        """Each expert takes its top-C tokens of each group by router score."""
        G, S, E = scores_GSE.shape
        cf = 1.0 if capacity_factor is None else capacity_factor
        C = min(S, self.expert_capacity or expert_capacity(cf, S, self.top_k, E))
        scores_GES = scores_GSE.transpose(1, 2)
        gates_GEC, tok_GEC = torch.topk(scores_GES, C, dim=-1)
        if self.routed_scaling_factor != 1.0:
            gates_GEC = gates_GEC * self.routed_scaling_factor
        tok_GEC = tok_GEC + (torch.arange(G, device=tok_GEC.device) * S).view(G, 1, 1)
        expert_GEC = torch.arange(E, device=tok_GEC.device).view(1, E, 1).expand(G, E, C)
        expert_A = expert_GEC.reshape(-1)
        return Routing(
            token_A=tok_GEC.reshape(-1), expert_A=expert_A, gate_A=gates_GEC.reshape(-1),
            slot_A=None, slots_per_token=0, num_tokens=G * S,
            routed_E=torch.bincount(expert_A, minlength=E),
            aux_losses={}, entropy=_entropy(balance_probs(scores_GSE, self.score_func)),
        )

    @torch.no_grad()
    def update_selection_bias(self, rate: float, load_E=None) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the rest.

        `load_E` defaults to the counts accumulated since the last call (pass an all-reduced
        copy under data parallelism so every rank moves the bias identically).
        """
        load_E = self.pending_load if load_E is None else load_E.to(self.pending_load)
        if load_E.sum() > 0:
            self.selection_bias += rate * torch.sign(load_E.mean() - load_E)
        self.pending_load.zero_()


def forced_balanced_ids(T: int, K: int, E: int, device) -> torch.Tensor:
    """long [T, K]: slot t*K+k goes to expert (t*K+k) % E (Megatron-Core's force-balance).

    The K experts of a token are distinct (K <= E), and every expert gets floor or ceil of
    T*K/E assignments (of S*K/E per group when E divides S*K, as groups start at g*S*K).
    """
    return (torch.arange(T * K, device=device) % E).reshape(T, K)


def _entropy(probs_GSE: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        p = probs_GSE.float()
        return -(p * torch.log(p.clamp_min(1e-20))).sum(-1).mean()
