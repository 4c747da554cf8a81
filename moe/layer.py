"""MoELayer: router -> dispatcher -> experts -> combine, a drop-in for a dense FFN.

Shapes: T tokens, D model dim, F ffn dim, E experts, K top-k, G routing groups (all leading
dims but the last two), S tokens per group (dim -2 of the input).
"""
import warnings

import torch
import torch.nn as nn
from torch.profiler import record_function  # named ranges for traces; ~free when not profiling

from .balance import (all_reduce_stats, check_balance_loss, local_terms, pooled_balance_loss,
                      sequence_balance_loss)
from .capacity import check_capacity_factor
from .dispatcher import LocalDispatcher
from .experts import DenseFFN, ExpertBank, check_activation
from .router import ROUTER_KINDS, Router
from .scoring import SCORE_FUNCS, check_group_args
from .stats import RoutingStats


FORCE_BALANCE_WARNING = ("MoELayer(force_balance=True): expert assignments are forced to an "
                         "even spread, the router's choice is ignored -- benchmarking only, "
                         "not for training a real model")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python


def _check_args(d_model, d_ff, num_experts, top_k, capacity_factor, eval_capacity_factor,
                router, num_shared_experts):
    for name, v in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if not _is_int(top_k) or top_k < 1:
        raise ValueError(f"top_k={top_k!r} must be an integer >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} is larger than num_experts={num_experts}; "
                         f"use top_k <= num_experts")
    for name, cf in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
        check_capacity_factor(cf, name)
    if router not in ROUTER_KINDS:
        raise ValueError(f"router={router!r} is not supported; use one of {ROUTER_KINDS}")
    if num_shared_experts < 0:
        raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")


def _check_routing_args(router, top_k, num_experts, capacity_factor, score_func, norm_topk_prob,
                        n_group, topk_group, routed_scaling_factor, expert_capacity,
                        num_shared_experts, shared_expert_gate) -> int:
    """Validate the routing options; returns topk_group resolved (None -> n_group)."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func={score_func!r} is not supported; use one of {SCORE_FUNCS}")
    if norm_topk_prob not in (None, True, False):
        raise ValueError(f"norm_topk_prob={norm_topk_prob!r} must be None (renormalise iff "
                         f"top_k >= 2), True or False")
    topk_group = check_group_args(num_experts, top_k, n_group, topk_group)
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)) \
            or not routed_scaling_factor > 0:
        raise ValueError(f"routed_scaling_factor={routed_scaling_factor!r} must be a positive number")
    if expert_capacity is not None:
        if not _is_int(expert_capacity) or expert_capacity < 1:
            raise ValueError(f"expert_capacity={expert_capacity!r} must be a positive integer or None")
        if capacity_factor is not None:
            raise ValueError(f"expert_capacity={expert_capacity} and capacity_factor="
                             f"{capacity_factor} both set the capacity; pass only one")
    if router == "expert_choice":
        if n_group > 1:
            raise ValueError(f"n_group={n_group} limits each token's experts to some groups, but "
                             f"router='expert_choice' lets experts pick tokens; use n_group=1 "
                             f"or router='token_choice'")
        if norm_topk_prob:
            raise ValueError("norm_topk_prob=True renormalises a token's top-k gates, which "
                             "router='expert_choice' does not have; leave it None")
    if shared_expert_gate and num_shared_experts == 0:
        raise ValueError("shared_expert_gate=True needs shared experts; set num_shared_experts >= 1")
    return topk_group


def _mask_GS(token_mask, shape, x_GSD):
    if tuple(token_mask.shape) != tuple(shape[:-1]):
        raise ValueError(f"token_mask has shape {tuple(token_mask.shape)}; it must be the input's "
                         f"shape without the last dim, {tuple(shape[:-1])}")
    return token_mask.reshape(x_GSD.shape[:2]).to(device=x_GSD.device, dtype=torch.bool)


class MoELayer(nn.Module):
    """Sparse FFN: y = sum over the token's selected experts of gate_e * expert_e(x).

    top_k=1: gate = router probability p_e (Switch). top_k>=2: the k selected probabilities
    renormalized to sum to 1 (GShard, Mixtral). capacity_factor=None is dropless; a float caps
    each expert at ceil(cf * S * K / E) assignments per routing group (a sequence), dropped
    assignments contribute zero. `aux_loss` holds the weighted aux losses of the last forward,
    `last_stats` its routing statistics.

    Routing options (keyword-only; the defaults are the behaviour above):
      score_func: "softmax" (default) or "sigmoid" (DeepSeek-V3): the router scores that gates
          come from; the selection bias is added to these scores for selection only.
      norm_topk_prob: None = renormalise the k selected gates iff top_k >= 2; True/False forces
          it for any k (Mixtral k=1: True gives gate 1.0; OLMoE, Qwen1.5/2-MoE: False).
      n_group, topk_group: group-limited top-k (DeepSeek-V3): experts split into n_group
          contiguous groups, only the topk_group groups with the largest sum of their top-2
          biased scores are eligible. n_group=1 (default): no limit.
      routed_scaling_factor: multiplies the gates after normalisation (DeepSeek-V3), so the
          expert weights stay those of the checkpoint. Default 1.0.
      router_bias: a learned bias [E] on the router logits (GPT-OSS, Switch router_bias).
      shared_expert_gate: the shared experts' output is scaled by sigmoid(x @ gate.T), with
          `shared_experts.gate` [1, D] (Qwen2-MoE); needs num_shared_experts >= 1.
      swiglu_alpha, swiglu_limit: constants of activation="clamped_swiglu" (GPT-OSS experts).
      logits_dtype, score_dtype: pin the dtype of the router logits / scores (e.g. "float32"),
          to reproduce checkpoints that route in fp32 whatever the model dtype. None: at least
          fp32, and fp64 for fp64 inputs.
      expert_capacity: a fixed number of assignments per expert per routing group, in train
          and eval (Switch checkpoints' expert_capacity); instead of capacity_factor.
      balance_loss: "sequence" (default), "micro_batch" or "global_batch": the tokens the
          load-balance loss averages over (moe/balance.py). The last two count over the
          ranks of `set_balance_group(group)`; "global_batch" also over the micro-batches
          since `reset_balance_window()`.
      experts_impl: "auto" (default), "loop" or "grouped_mm": how the experts run (moe/
          experts.py, moe/grouped_mm.py); "auto" takes the measured-faster one for the
          device and dtype. Same function either way.
      force_balance: BENCHMARKING ONLY. Token choice ignores the router's expert choice and
          sends assignment t*K+k to expert (t*K+k) % E (exactly balanced when E divides
          S*K), keeping the gate values the router gave; gradients still flow. Warns when
          on; `layer.force_balance` and the repr expose it so a trainer can say so.
      replica_slots: R >= 0 extra expert slots per rank of the expert-parallel group (0 = off).
          Each forward, the hottest experts of that step get replicas on the least-loaded
          ranks and their rows are split between the copies (moe/placement.py); replica
          weights are fetched from the owners, their gradients summed back into the owners
          (moe/ep_dispatcher.py). Same function as R = 0. Takes effect when the layer is
          sharded over an ep group of more than one rank (an error otherwise).
          `last_stats.rank_rows` / `.rank_rows_unreplicated`: rows per ep rank with / without.
    `forward(x, token_mask=None)`: token_mask (bool, x.shape[:-1]) marks the tokens that
    count in the balance loss (False: padding); every token is still routed and computed.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 2,
                 capacity_factor=None, activation: str = "gelu", ep_group=None, *,
                 router: str = "token_choice", eval_capacity_factor="same",
                 aux_loss_coef: float = 1e-2, z_loss_coef: float = 1e-3, jitter: float = 0.0,
                 num_shared_experts: int = 0, shared_d_ff=None, expert_bias: bool = False,
                 init_std: float = 0.02, out_init_std=None, score_func: str = "softmax",
                 norm_topk_prob=None, n_group: int = 1, topk_group=None,
                 routed_scaling_factor: float = 1.0, router_bias: bool = False,
                 shared_expert_gate: bool = False, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, logits_dtype=None, score_dtype=None,
                 expert_capacity=None, balance_loss: str = "sequence",
                 experts_impl: str = "auto", force_balance: bool = False,
                 replica_slots: int = 0):
        super().__init__()
        eval_cf = capacity_factor if eval_capacity_factor == "same" else eval_capacity_factor
        _check_args(d_model, d_ff, num_experts, top_k, capacity_factor, eval_cf, router,
                    num_shared_experts)
        topk_group = _check_routing_args(
            router, top_k, num_experts, capacity_factor, score_func, norm_topk_prob, n_group,
            topk_group, routed_scaling_factor, expert_capacity, num_shared_experts,
            shared_expert_gate)
        check_activation(activation)
        check_balance_loss(balance_loss, router)
        if force_balance not in (True, False):
            raise ValueError(f"force_balance={force_balance!r} must be True or False")
        if force_balance and router != "token_choice":
            raise ValueError(f"force_balance=True spreads token-choice assignments; router="
                             f"{router!r} is balanced by construction: use router='token_choice'")
        if force_balance:
            warnings.warn(FORCE_BALANCE_WARNING, stacklevel=2)
        if not _is_int(replica_slots) or replica_slots < 0:
            raise ValueError(f"replica_slots={replica_slots!r} must be an integer >= 0 (0 = no "
                             f"hot-expert replicas)")
        self.replica_slots = replica_slots
        self.balance_loss = balance_loss
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_cf
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = Router(d_model, num_experts, top_k, router, jitter, init_std,
                             score_func=score_func, norm_topk_prob=norm_topk_prob,
                             n_group=n_group, topk_group=topk_group,
                             routed_scaling_factor=routed_scaling_factor,
                             router_bias=router_bias, logits_dtype=logits_dtype,
                             score_dtype=score_dtype, expert_capacity=expert_capacity,
                             force_balance=force_balance)
        glu = dict(swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        self.experts = ExpertBank(num_experts, d_model, d_ff, activation, expert_bias,
                                  init_std, out_init_std, experts_impl=experts_impl, **glu)
        self.shared_experts = None
        if num_shared_experts > 0:
            self.shared_experts = DenseFFN(d_model, (shared_d_ff or d_ff) * num_shared_experts,
                                           activation, expert_bias, init_std,
                                           output_gate=shared_expert_gate, **glu)
        self.dispatcher = LocalDispatcher(num_experts)
        # global_batch: assignments per expert and token count since reset_balance_window()
        self.register_buffer("balance_window", torch.zeros(num_experts + 1, dtype=torch.long),
                             persistent=False)
        self.balance_group = None
        self.ep_group = None
        self.aux_loss = torch.zeros(())
        self.aux_losses = {}
        self.last_stats = None
        if ep_group is not None:
            self.set_ep_group(ep_group)

    def set_ep_group(self, ep_group) -> None:
        """Keep only this rank's experts [r*E/P, (r+1)*E/P) and exchange tokens over ep_group."""
        from .ep_dispatcher import shard_layer_experts  # moe/ep_dispatcher.py
        shard_layer_experts(self, ep_group)

    @property
    def force_balance(self) -> bool:
        """True when routing is overridden by force_balance (benchmarking, not training)."""
        return self.router.force_balance

    def set_balance_group(self, group) -> None:
        """Data-parallel ranks over which micro_batch/global_batch balance losses count tokens
        (None: this process only). Handed in by the parallel setup, never read from a global."""
        self.balance_group = group

    def reset_balance_window(self) -> None:
        """Start a new global_batch window (call once per optimizer step, before its first
        micro-batch)."""
        self.balance_window.zero_()

    def forward(self, x: torch.Tensor, token_mask=None) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"MoELayer expects input of shape [..., d_model={self.d_model}], "
                             f"got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"MoELayer input must be a floating tensor, got {x.dtype}")
        shape, D = x.shape, self.d_model
        S = shape[-2] if x.dim() >= 2 else 1
        x_GSD = x.reshape(-1, S, D)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        with record_function("moe.router"):
            routing = self.router(x_GSD, cf)
            # per-sequence balance without a mask needs no communication: every data-parallel
            # rank holds the same number of sequences, so the dp mean of the local means is
            # the global mean; a mask (or a pooled variant) makes the counts differ per rank
            if routing.probs_GSE is not None and (token_mask is not None
                                                  or self.balance_loss != "sequence"):
                mask_GS = None if token_mask is None else _mask_GS(token_mask, shape, x_GSD)
                routing.aux_losses["load_balance"] = self._balance(routing, mask_GS)
        x_TD = x_GSD.reshape(-1, D)
        with record_function("moe.dispatch"):
            # counts stay on the device when the experts take device offsets (grouped_mm)
            host = self.experts.impl_for(x_TD) != "grouped_mm"
            x_ND, counts_E, meta = self.dispatcher.dispatch(x_TD, routing, host_counts=host)
        with record_function("moe.experts"):
            y_ND = self.experts(x_ND, counts_E,
                                lambda weights: self.dispatcher.expert_weights(weights, meta))
        with record_function("moe.combine"):
            y_TD = self.dispatcher.combine(y_ND, meta, x.dtype)
        if self.shared_experts is not None:
            with record_function("moe.shared_experts"):
                y_TD = y_TD + self.shared_experts(x_TD)
        self._record(routing, meta)
        return y_TD.reshape(shape)

    def _balance(self, routing, mask_GS):
        probs_GSE, ids_GSK = routing.probs_GSE, routing.ids_GSK
        if self.balance_loss == "sequence":
            return sequence_balance_loss(probs_GSE, ids_GSK, mask_GS, self.balance_group)
        stats, psum_E = local_terms(probs_GSE, ids_GSK, mask_GS)
        stats, world = all_reduce_stats(stats, self.balance_group)
        f_stats = stats
        if self.balance_loss == "global_batch" and self.training:
            self.balance_window += stats.to(self.balance_window.device)
            f_stats = self.balance_window
        return pooled_balance_loss(psum_E, f_stats, int(stats[-1]), world, self.top_k)

    def _record(self, routing, meta) -> None:
        self.aux_losses = routing.aux_losses
        coefs = {"load_balance": self.aux_loss_coef, "z_loss": self.z_loss_coef}
        self.aux_loss = sum(coefs[k] * v for k, v in routing.aux_losses.items())
        with torch.no_grad():
            self.last_stats = RoutingStats(routing.routed_E.detach(), routing.kept_E.detach(),
                                           routing.num_tokens, self.top_k, routing.entropy,
                                           meta.rank_rows, meta.rank_rows_unreplicated)

    def extra_repr(self) -> str:
        s = (f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, "
             f"top_k={self.top_k}, capacity_factor={self.capacity_factor}")
        if self.experts.experts_impl != "auto":
            s += f", experts_impl={self.experts.experts_impl!r}"
        if self.replica_slots:
            s += f", replica_slots={self.replica_slots}"
        return s + (", force_balance=True (BENCHMARK ONLY: routing ignored)"
                    if self.force_balance else "")

    def routing_summary(self) -> str:
        """One line with every routing semantic of this layer (printed by train.py at start)."""
        r = self.router
        parts = [f"E={self.num_experts} top_k={self.top_k} {r.kind} {r.score_func}",
                 f"norm_topk_prob={r.norm_topk_prob}",
                 f"capacity_factor={self.capacity_factor}",
                 f"activation={self.experts.activation}",
                 f"balance_loss={self.balance_loss} aux_coef={self.aux_loss_coef} "
                 f"z_coef={self.z_loss_coef}"]
        if r.n_group > 1:
            parts.append(f"groups={r.n_group} keep {r.topk_group}")
        if r.routed_scaling_factor != 1.0:
            parts.append(f"routed_scaling={r.routed_scaling_factor:g}")
        if r.bias is not None:
            parts.append("router_bias")
        if self.shared_experts is not None:
            gated = self.shared_experts.gate is not None
            parts.append("shared experts" + (" (sigmoid-gated)" if gated else ""))
        if self.replica_slots:
            parts.append(f"replica_slots={self.replica_slots}")
        if self.force_balance:
            parts.append("FORCE-BALANCED (benchmark only: routing ignored)")
        return ", ".join(parts)
