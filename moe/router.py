"""Routers: token-choice top-k (Switch k=1, GShard/Mixtral k>=2, DeepSeek-V3) and expert-choice.

Shapes: T tokens, D model dim, E experts, K top-k, G routing groups, S tokens per group,
C expert capacity per group, A assignments.
Logits and scores are fp32 for fp32/bf16/fp16 inputs (fp64 inputs stay fp64, so a float64
reference run is exact), whatever the parameter dtype, unless `logits_dtype`/`score_dtype`
pin them. A bf16 input gets fp32 logits from one GEMM with an fp32 result, without an fp32
copy of the input (moe/router_ops.py): bf16-rounded logits flip with the GEMM's row blocking,
so layouts that split the tokens differently (cp) would route apart. The scores, z-loss and
entropy come from one fused op.
Routing has static shapes and never waits for the device: counts are scatters, capacity a
sort and a binary search (moe/capacity.py).
The scoring and selection steps themselves are pure functions in moe/scoring.py.
"""
import torch
import torch.nn as nn

from .capacity import capacity_keep_mask, expert_capacity
from .config import RoutingConfig
from .dtypes import accumulation_dtype
from .losses import router_z_loss
from .router_ops import LOW_PRECISION, mean_entropy, plain, router_logits, score_stats
from .routing import Routing, count_ids, count_per_group, recomputing
from .scoring import balance_probs, gates_for, scores_from_logits, select_experts


class Router(nn.Module):
    """Linear router with optional bias, jitter, aux-loss-free selection bias and capacity.

    `config` (a RoutingConfig) holds every routing setting. `weight` is [E, D]; logits =
    x @ weight.T (+ `bias` [E] if config.router_bias). `selection_bias` ([E], no gradient) is
    added to the scores only when choosing experts (DeepSeek-V3 aux-loss-free balancing), for
    softmax and sigmoid scores alike; gate values always come from the unbiased scores. The
    bias is moved by an explicit `update_selection_bias` call, never inside forward. See
    moe/scoring.py for score_func, norm_topk_prob, n_group, topk_group, max_nodes and
    routed_scaling_factor. The load-balance loss is not computed here: the Routing carries
    the probabilities and choices it needs (moe/losses.py owns it).
    """

    def __init__(self, d_model: int, config: RoutingConfig, init_std: float = 0.02):
        super().__init__()
        self.config = config
        self.init_std = init_std
        E = config.num_experts
        self.weight = nn.Parameter(torch.empty(E, d_model))
        self.bias = nn.Parameter(torch.empty(E)) if config.router_bias else None
        self.register_buffer("selection_bias", torch.zeros(E, dtype=torch.float32))
        # routed-assignment counts accumulated since the last bias update (training only)
        self.register_buffer("pending_load", torch.zeros(E, dtype=torch.long), persistent=False)
        self.reset_parameters()

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def top_k(self) -> int:
        return self.config.top_k

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        c = self.config
        dtype = c.logits_dtype or accumulation_dtype(x_TD.dtype)
        jitter = self.training and c.jitter > 0
        if x_TD.dtype in LOW_PRECISION and dtype == torch.float32 and not jitter \
                and plain(x_TD, self.weight):  # no fp32 copy of x (moe/router_ops.py)
            logits_TE = router_logits(x_TD, self.weight)
            return logits_TE if self.bias is None else logits_TE + self.bias.to(dtype)
        x32_TD = x_TD.to(dtype)
        if jitter:
            noise = torch.empty_like(x32_TD).uniform_(1.0 - c.jitter, 1.0 + c.jitter)
            x32_TD = x32_TD * noise
        logits_TE = x32_TD @ self.weight.to(dtype).t()
        return logits_TE if self.bias is None else logits_TE + self.bias.to(dtype)

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """softmax/sigmoid of the logits, in score_dtype when set (else the logits' dtype)."""
        c = self.config
        return scores_from_logits(logits_TE.to(c.score_dtype or logits_TE.dtype), c.score_func)

    def score_stats(self, logits_GSE: torch.Tensor):
        """(scores, z_loss, entropy) of the logits: one fused op where the scores keep the
        logits' dtype (moe/router_ops.py), the same three computations otherwise."""
        c = self.config
        if (c.score_dtype is None or c.score_dtype == logits_GSE.dtype) and plain(logits_GSE):
            return score_stats(logits_GSE, c.score_func)
        scores_GSE = self.scores(logits_GSE)
        return (scores_GSE, router_z_loss(logits_GSE),
                mean_entropy(balance_probs(scores_GSE, c.score_func)))

    def forward(self, x_GSD: torch.Tensor, capacity_factor, replay_ids=None) -> Routing:
        """replay_ids (long [G, S, K] or [G*S, K], None: choose): router replay -- these experts
        are used instead of the top-k; the gates are the current scores at them (renormalised
        and scaled as configured), so the router keeps its gradient. Capacity applies to the
        replayed assignments as to chosen ones (moe/capacity.py: in token order); the balance
        loss and routed counts see the replayed choices with the current probabilities."""
        G, S, D = x_GSD.shape
        logits_GSE = self.logits(x_GSD.reshape(G * S, D)).reshape(G, S, self.num_experts)
        scores_GSE, z_loss, entropy = self.score_stats(logits_GSE)
        if self.config.kind == "expert_choice":
            if replay_ids is not None:
                raise ValueError("router replay needs token-choice routing (moe.router="
                                 "expert_choice picks tokens per expert, not experts per token)")
            routing = self._expert_choice(scores_GSE, capacity_factor, z_loss, entropy)
        else:
            routing = self._token_choice(scores_GSE, capacity_factor, z_loss, entropy, replay_ids,
                                         logits_GSE)
        if self.training and not recomputing():  # a recompute routed these tokens already
            self.pending_load += routing.routed_E
        return routing

    def _capacity(self, capacity_factor, S: int):
        """Assignments each expert may take per group, or None (dropless)."""
        c = self.config
        if c.expert_capacity is not None:
            return c.expert_capacity
        if capacity_factor is None:
            return None
        return expert_capacity(capacity_factor, S, c.top_k, c.num_experts)

    def _token_choice(self, scores_GSE, capacity_factor, z_loss, entropy, replay_ids=None,
                      logits_GSE=None) -> Routing:
        c = self.config
        G, S, E = scores_GSE.shape
        K, T = c.top_k, G * S
        scores_TE = scores_GSE.reshape(T, E)
        if replay_ids is None:
            ids_TK = select_experts(scores_TE, self.selection_bias, K, c.n_group, c.topk_group,
                                    expert_nodes=c.expert_nodes, max_nodes=c.max_nodes)
        else:
            ids_TK = replayed_ids(replay_ids, T, K, E, scores_GSE.device)
        # the shortcut's rounding differs from softmax-then-renormalise at 1e-7 in fp32: not
        # where the dtypes are pinned to reproduce a checkpoint's arithmetic
        same = c.score_func == "softmax" and c.logits_dtype is None and c.score_dtype is None
        softmax_logits = logits_GSE.reshape(T, E) if same else None
        gates_TK = gates_for(scores_TE, ids_TK, c.norm_topk_prob, c.routed_scaling_factor,
                             softmax_logits)
        if c.force_balance:  # benchmarking: same gates, experts dealt round-robin
            if replay_ids is not None:
                raise ValueError("router replay with moe.force_balance=true: the forced "
                                 "round-robin would override the replayed experts; set one")
            ids_TK = forced_balanced_ids(T, K, E, scores_GSE.device)
        ids_GSK = ids_TK.reshape(G, S, K)
        expert_A, gate_A = ids_TK.reshape(-1), gates_TK.reshape(-1)
        routed_GE = count_per_group(ids_GSK, E)  # also the balance loss's f
        routed_E = routed_GE.sum(0) if G > 1 else routed_GE.view(E)
        kept_E, capacity = routed_E, self._capacity(capacity_factor, S)
        if capacity is not None:  # a dropped assignment keeps its slot: expert E, gate 0
            keep_A = capacity_keep_mask(ids_GSK, E, capacity).reshape(-1)
            expert_A = torch.where(keep_A, expert_A, E)
            gate_A = gate_A * keep_A
            kept_E = count_ids(expert_A, E)
        probs_GSE = balance_probs(scores_GSE, c.score_func)
        return Routing(
            expert_A=expert_A, gate_A=gate_A, slots_per_token=K, num_tokens=T,
            routed_E=routed_E, kept_E=kept_E, z_loss=z_loss, entropy=entropy,
            probs_GSE=probs_GSE, ids_GSK=ids_GSK, dropped=capacity is not None,
            routed_GE=routed_GE,
        )

    def _expert_choice(self, scores_GSE, capacity_factor, z_loss, entropy) -> Routing:
        """Each expert takes its top-C tokens of each group by router score."""
        c = self.config
        G, S, E = scores_GSE.shape
        cf = 1.0 if capacity_factor is None else capacity_factor
        C = min(S, c.expert_capacity or expert_capacity(cf, S, c.top_k, E))
        scores_GES = scores_GSE.transpose(1, 2)
        gates_GEC, tok_GEC = torch.topk(scores_GES, C, dim=-1)
        if c.routed_scaling_factor != 1.0:
            gates_GEC = gates_GEC * c.routed_scaling_factor
        tok_GEC = tok_GEC + (torch.arange(G, device=tok_GEC.device) * S).view(G, 1, 1)
        expert_GEC = torch.arange(E, device=tok_GEC.device).view(1, E, 1).expand(G, E, C)
        expert_A = expert_GEC.reshape(-1)
        counts_E = torch.full((E,), G * C, dtype=torch.long, device=tok_GEC.device)
        return Routing(
            expert_A=expert_A, gate_A=gates_GEC.reshape(-1), fan_in_tokens_A=tok_GEC.reshape(-1),
            slots_per_token=0, num_tokens=G * S,
            routed_E=counts_E, kept_E=counts_E,
            z_loss=z_loss, entropy=entropy,
        )

    @torch.no_grad()
    def update_selection_bias(self, rate: float, load_E=None, applied=None) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the rest.

        `load_E` defaults to the counts accumulated since the last call (pass an all-reduced
        copy under data parallelism so every rank moves the bias identically). `applied`: a
        0-dim tensor, 1 when the optimizer step was taken and 0 when it was skipped (decided on
        the device, train.step_checks=device): a skipped step moves nothing and keeps its load
        pending, as a skip decided on the host (no call) does. Nothing is read on the host.
        """
        load_E = (self.pending_load if load_E is None else load_E).to(self.selection_bias.dtype)
        move_E = torch.sign(load_E.mean() - load_E) * (load_E.sum() > 0)  # no load: no move
        if applied is None:
            self.pending_load.zero_()
        else:
            move_E = move_E * applied
            self.pending_load.mul_((1 - applied).to(self.pending_load.dtype))
        self.selection_bias += rate * move_E


def forced_balanced_ids(T: int, K: int, E: int, device) -> torch.Tensor:
    """long [T, K]: slot t*K+k goes to expert (t*K+k) % E (Megatron-Core's force-balance).

    The K experts of a token are distinct (K <= E), and every expert gets floor or ceil of
    T*K/E assignments (of S*K/E per group when E divides S*K, as groups start at g*S*K).
    """
    return (torch.arange(T * K, device=device) % E).reshape(T, K)


def replayed_ids(ids, T: int, K: int, E: int, device) -> torch.Tensor:
    """Recorded expert ids as long [T, K] on `device`, or ValueError naming what is wrong."""
    ids = torch.as_tensor(ids)
    if ids.numel() != T * K or ids.shape[-1] != K:
        raise ValueError(f"router replay: expert ids of shape {tuple(ids.shape)} do not match "
                         f"{T} tokens x top_k={K}; record them from the same tokens and moe.top_k")
    if ids.is_floating_point() or (ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < E):
        raise ValueError(f"router replay: expert ids must be integers in [0, {E}) "
                         f"(moe.num_experts={E}); these were recorded for another model")
    return ids.reshape(T, K).to(device=device, dtype=torch.long)
