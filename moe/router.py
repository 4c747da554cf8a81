"""Routers: token-choice top-k (Switch k=1, GShard/Mixtral k>=2) and expert-choice.

Shapes: T tokens, D model dim, E experts, K top-k, G routing groups, S tokens per group,
C expert capacity per group, A assignments.
Logits and probabilities are fp32 for fp32/bf16/fp16 inputs (fp64 inputs stay fp64, so a
float64 reference run is exact), whatever the parameter dtype.
"""
import torch
import torch.nn as nn

from .capacity import capacity_keep_mask, expert_capacity
from .losses import load_balance_loss, router_z_loss
from .routing import Routing

ROUTER_KINDS = ("token_choice", "expert_choice")


class Router(nn.Module):
    """Linear router with optional jitter, aux-loss-free selection bias and capacity.

    `weight` is [E, D]; logits = x @ weight.T in fp32. `selection_bias` ([E], no gradient) is
    added to the probabilities only when choosing experts (DeepSeek-V3 aux-loss-free
    balancing); gate values always come from the unbiased probabilities. The bias is moved by
    an explicit `update_selection_bias` call, never inside forward.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, kind: str = "token_choice",
                 jitter: float = 0.0, init_std: float = 0.02):
        super().__init__()
        self.num_experts, self.top_k, self.kind = num_experts, top_k, kind
        self.jitter, self.init_std = jitter, init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.register_buffer("selection_bias", torch.zeros(num_experts, dtype=torch.float32))
        # routed-assignment counts accumulated since the last bias update (training only)
        self.register_buffer("pending_load", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        x32_TD = x_TD.to(dtype)
        if self.training and self.jitter > 0:
            noise = torch.empty_like(x32_TD).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            x32_TD = x32_TD * noise
        return x32_TD @ self.weight.to(dtype).t()

    def forward(self, x_GSD: torch.Tensor, capacity_factor) -> Routing:
        G, S, D = x_GSD.shape
        logits_GSE = self.logits(x_GSD.reshape(G * S, D)).reshape(G, S, self.num_experts)
        probs_GSE = torch.softmax(logits_GSE, dim=-1)
        if self.kind == "expert_choice":
            routing = self._expert_choice(probs_GSE, capacity_factor)
        else:
            routing = self._token_choice(probs_GSE, capacity_factor)
        routing.aux_losses["z_loss"] = router_z_loss(logits_GSE)
        if self.training:
            self.pending_load += routing.routed_E.to(self.pending_load.dtype)
        return routing

    def _token_choice(self, probs_GSE, capacity_factor) -> Routing:
        G, S, E = probs_GSE.shape
        K = self.top_k
        with torch.no_grad():
            scores_GSE = probs_GSE + self.selection_bias
            ids_GSK = torch.topk(scores_GSE, K, dim=-1).indices
        gates_GSK = probs_GSE.gather(-1, ids_GSK)
        if K > 1:
            gates_GSK = gates_GSK / gates_GSK.sum(dim=-1, keepdim=True)
        T = G * S
        slot_A = torch.arange(T * K, device=probs_GSE.device)
        if capacity_factor is not None:
            keep_GSK = capacity_keep_mask(ids_GSK, E, expert_capacity(capacity_factor, S, K, E))
            slot_A = slot_A[keep_GSK.reshape(-1)]
        return Routing(
            token_A=torch.div(slot_A, K, rounding_mode="floor"),
            expert_A=ids_GSK.reshape(-1)[slot_A],
            gate_A=gates_GSK.reshape(-1)[slot_A],
            slot_A=slot_A, slots_per_token=K, num_tokens=T,
            routed_E=torch.bincount(ids_GSK.reshape(-1), minlength=E),
            aux_losses={"load_balance": load_balance_loss(probs_GSE, ids_GSK)},
            entropy=_entropy(probs_GSE),
        )

    def _expert_choice(self, probs_GSE, capacity_factor) -> Routing:
        """Each expert takes its top-C tokens of each group by router probability."""
        G, S, E = probs_GSE.shape
        cf = 1.0 if capacity_factor is None else capacity_factor
        C = min(S, expert_capacity(cf, S, self.top_k, E))
        probs_GES = probs_GSE.transpose(1, 2)
        gates_GEC, tok_GEC = torch.topk(probs_GES, C, dim=-1)
        tok_GEC = tok_GEC + (torch.arange(G, device=tok_GEC.device) * S).view(G, 1, 1)
        expert_GEC = torch.arange(E, device=tok_GEC.device).view(1, E, 1).expand(G, E, C)
        expert_A = expert_GEC.reshape(-1)
        return Routing(
            token_A=tok_GEC.reshape(-1), expert_A=expert_A, gate_A=gates_GEC.reshape(-1),
            slot_A=None, slots_per_token=0, num_tokens=G * S,
            routed_E=torch.bincount(expert_A, minlength=E),
            aux_losses={}, entropy=_entropy(probs_GSE),
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


def _entropy(probs_GSE: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        p = probs_GSE.float()
        return -(p * torch.log(p.clamp_min(1e-20))).sum(-1).mean()
