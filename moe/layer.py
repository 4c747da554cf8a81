"""MoELayer: router -> dispatcher -> experts -> combine, a drop-in for a dense FFN.

Shapes: T tokens, D model dim, F ffn dim, E experts, K top-k, G routing groups (all leading
dims but the last two), S tokens per group (dim -2 of the input).
"""
import dataclasses
import warnings

import torch
import torch.nn as nn
from torch.profiler import record_function  # named ranges for traces; ~free when not profiling

from .config import RoutingConfig
from .dispatcher import LocalDispatcher
from .experts import DenseFFN, ExpertBank, check_activation, pad_rows
from .losses import BalanceLoss
from .router import Router
from .stats import RoutingStats
from .wire import check_dispatch_dtype, wire_formats


DISPATCH_MODES = ("flat", "hierarchical")
FORCE_BALANCE_WARNING = ("MoELayer(force_balance=True): expert assignments are forced to an "
                         "even spread, the router's choice is ignored -- benchmarking only, "
                         "not for training a real model")


def _check_layer_args(d_model, d_ff, num_shared_experts, shared_expert_gate, replica_slots):
    """What the routing config does not check: sizes, shared experts, replicas."""
    for name, v in (("d_model", d_model), ("d_ff", d_ff)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")
    if num_shared_experts < 0:
        raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")
    if shared_expert_gate and num_shared_experts == 0:
        raise ValueError("shared_expert_gate=True needs shared experts; set num_shared_experts >= 1")
    if not isinstance(replica_slots, int) or isinstance(replica_slots, bool) or replica_slots < 0:
        raise ValueError(f"replica_slots={replica_slots!r} must be an integer >= 0 (0 = no "
                         f"hot-expert replicas)")


def _check_overlap_degree(d) -> None:
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"a2a_overlap_degree={d!r} must be an integer >= 1 (1 = the exchange "
                         f"is not split; d > 1 overlaps d chunks' all-to-alls with the experts)")


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
          load-balance loss averages over (moe/losses.py). The last two count over the
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
      a2a_overlap_degree: d >= 1 (1 = off). Under expert parallelism the dispatched rows are
          cut into d chunks (every expert's rows split evenly, routing untouched) and chunk
          c+1's all-to-all flies while the experts compute chunk c; combine and backward
          overlap likewise, and the shared experts run while the first dispatch flies
          (moe/chunked_a2a.py). Same function as d = 1. Takes effect when the layer is sharded
          over an ep group of more than one rank (an error otherwise).
      dispatch_dtype: "auto" (default), "fp32", "bf16" or "fp8": the format of the rows in
          the expert all-to-all, each direction (moe/wire.py): auto = the compute dtype
          (autocast's, else the input's); fp8 = e4m3 rows with one fp32 scale per 128
          channels for the forward dispatch, bf16 for the combine and both backwards. Part
          of the layer's function: one process applies the same rounding at the same points.
      dispatch: "flat" (default) or "hierarchical": under expert parallelism over several
          nodes, hierarchical sends each token across to a node once, to the rank with the
          same local index there, which forwards it to its node's experts; the combine sums
          each token's expert outputs inside the node before they cross back (moe/
          hierarchical.py). Same function up to the combine's summation order. Nodes come
          from `set_expert_nodes` (parallel.gpus_per_node); until then one node.
      max_nodes: M >= 1 or None (default, no limit): node-limited routing (DeepSeek-V3):
          each token first keeps the M nodes whose experts score highest (the sum of their
          top max(1, k // M) scores + selection bias), then its top-k experts among those.
          The nodes are the ones the experts live on (`set_expert_nodes`); on one node
          every token reaches one node, so the limit holds with plain top-k.
      gates_in_experts: False (default) weighs each expert output by its gate in the
          combine, which keeps the [rows, d_model] outputs for the gates' gradient; True
          scales each row's hidden activation by its gate inside the expert, before the
          output projection, and the combine is a plain sum (moe/row_gates.py: one d_model
          row and, outside FP8, the activation output's d_ff row less held per routed
          assignment; under expert parallelism the gates travel to the experts, fp32, one
          small all-to-all each way). Same function, rounded at another point.
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
                 replica_slots: int = 0, a2a_overlap_degree: int = 1,
                 dispatch_dtype: str = "auto", dispatch: str = "flat", max_nodes=None,
                 gates_in_experts: bool = False):
        super().__init__()
        config = RoutingConfig(
            num_experts=num_experts, top_k=top_k, kind=router, capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor, expert_capacity=expert_capacity,
            jitter=jitter, score_func=score_func, norm_topk_prob=norm_topk_prob, n_group=n_group,
            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
            router_bias=router_bias, logits_dtype=logits_dtype, score_dtype=score_dtype,
            force_balance=force_balance, balance_loss=balance_loss, max_nodes=max_nodes)
        _check_layer_args(d_model, d_ff, num_shared_experts, shared_expert_gate, replica_slots)
        _check_overlap_degree(a2a_overlap_degree)
        check_dispatch_dtype(dispatch_dtype)
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch={dispatch!r} (moe.dispatch) is not supported; use one of "
                             f"{DISPATCH_MODES}")
        check_activation(activation)
        if force_balance:
            warnings.warn(FORCE_BALANCE_WARNING, stacklevel=2)
        self.replica_slots = replica_slots
        self.a2a_overlap_degree = a2a_overlap_degree
        self.dispatch_dtype = dispatch_dtype
        self.dispatch = dispatch
        if not isinstance(gates_in_experts, bool):
            raise ValueError(f"gates_in_experts={gates_in_experts!r} (moe.gates_in_experts) must be "
                             f"true or false")
        self.gates_in_experts = gates_in_experts
        self.timeline = None  # set_timeline: a moe/profiling/timeline.py Timeline, or None
        self.a2a_waiter = None  # set_a2a_waiter: waits for the exchanges (parallel/interleave.py)
        self.experts_release = None  # set_experts_release: after the chunks' experts (ZeRO-3)
        self.d_model, self.d_ff = d_model, d_ff
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = Router(d_model, config, init_std)
        glu = dict(swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
        self.experts = ExpertBank(num_experts, d_model, d_ff, activation, expert_bias,
                                  init_std, out_init_std, experts_impl=experts_impl, **glu)
        self.shared_experts = None
        if num_shared_experts > 0:
            self.shared_experts = DenseFFN(d_model, (shared_d_ff or d_ff) * num_shared_experts,
                                           activation, expert_bias, init_std,
                                           output_gate=shared_expert_gate, **glu)
        self.balance = BalanceLoss(balance_loss, num_experts, top_k)
        self.dispatcher = LocalDispatcher(num_experts)
        self.ep_group = None
        self.etp_group = None  # set by set_etp_group: each expert's d_ff split over its ranks
        self.shared_run_outside = False  # set_shared_run_outside: the caller runs shared_experts
        self.aux_loss = torch.zeros(())
        self.aux_losses = {}
        self.last_stats = None
        if ep_group is not None:
            self.set_ep_group(ep_group)

    # the routing settings, read from the one config the router consumes
    num_experts = property(lambda self: self.router.config.num_experts)
    top_k = property(lambda self: self.router.config.top_k)
    capacity_factor = property(lambda self: self.router.config.capacity_factor)
    eval_capacity_factor = property(lambda self: self.router.config.eval_capacity_factor)
    balance_loss = property(lambda self: self.router.config.balance_loss)

    def set_ep_group(self, ep_group) -> None:
        """Keep only this rank's experts [r*E/P, (r+1)*E/P) and exchange tokens over ep_group."""
        from .ep_dispatcher import shard_layer_experts  # moe/ep_dispatcher.py
        shard_layer_experts(self, ep_group)

    def set_expert_nodes(self, nodes) -> None:
        """Tell the sharded layer which of its ep ranks share a node (a moe/nodes.py
        ExpertNodes): the hierarchical dispatch crosses nodes once per token and node, and
        max_nodes counts these nodes. Handed in by the parallel setup (parallel/expert.py)."""
        if self.ep_group is None:
            raise ValueError("set_expert_nodes: shard the layer first (set_ep_group)")
        if self.dispatch == "hierarchical":
            from .hierarchical import HierarchicalDispatcher
            self.dispatcher = HierarchicalDispatcher(self.num_experts, self.ep_group,
                                                     self.replica_slots, nodes)
        self.router.config = dataclasses.replace(self.router.config, expert_nodes=nodes.num_nodes)

    def set_etp_group(self, etp_group) -> None:
        """Keep this rank's block of every expert's d_ff and run the experts over etp_group
        (expert tensor parallelism, moe/expert_tp.py); composes with set_ep_group."""
        from .expert_tp import split_layer_ffn
        split_layer_ffn(self, etp_group)

    def set_shared_run_outside(self) -> None:
        """forward no longer adds shared_experts(x): the caller runs them on its own layout
        and adds their output (2-D tensor parallelism splits them over its grid where the
        routed experts get whole tokens: parallel/tensor/grid.py). The parameters stay here."""
        if self.shared_experts is None:
            raise ValueError("set_shared_run_outside: this layer has no shared experts")
        self.shared_run_outside = True

    @property
    def force_balance(self) -> bool:
        """True when routing is overridden by force_balance (benchmarking, not training)."""
        return self.router.config.force_balance

    def set_balance_group(self, group) -> None:
        """Data-parallel ranks over which micro_batch/global_batch balance losses count tokens
        (None: this process only). Handed in by the parallel setup, never read from a global."""
        self.balance.group = group

    def set_sequence_group(self, group) -> None:
        """Ranks holding parts of the same sequences (context parallelism; tensor parallelism's
        sequence split), over which the sequence balance loss sums per-sequence statistics:
        a group, a tuple of groups whose ranks together hold each sequence (summed over
        each in turn), or None (whole sequences here)."""
        self.balance.seq_group = group

    def reset_balance_window(self) -> None:
        """Start a new global_batch window (call once per optimizer step, before its first
        micro-batch)."""
        self.balance.reset_window()

    def forward(self, x: torch.Tensor, token_mask=None, expert_ids=None) -> torch.Tensor:
        """x [..., D] -> [..., D]. expert_ids (long [..., K], x's leading shape): router replay,
        route each token to these experts instead of the router's top-k (Router.forward)."""
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
            routing = self.router(x_GSD, cf, expert_ids)
            losses = {}
            if routing.probs_GSE is not None:  # token choice (expert choice is balanced)
                mask_GS = None if token_mask is None else _mask_GS(token_mask, shape, x_GSD)
                losses["load_balance"] = self.balance(routing.probs_GSE, routing.ids_GSK, mask_GS,
                                                      routing.routed_GE)
            losses["z_loss"] = routing.z_loss
        x_TD = x_GSD.reshape(-1, D)
        wires = wire_formats(self.dispatch_dtype, x_TD)  # (dispatch, combine)
        if self._overlapped():
            y_TD, meta = self._overlapped_forward(x_TD, routing, x.dtype, wires)
        else:
            with record_function("moe.dispatch"):
                x_ND, counts_E, meta = self.dispatcher.dispatch(x_TD, routing, wires[0], self.a2a_waiter)
                gate_N = self.dispatcher.gates(meta, self.a2a_waiter) if self.gates_in_experts else None
            with record_function("moe.experts"):
                extend = lambda weights: self.dispatcher.expert_weights(weights, meta)  # noqa: E731
                y_ND = self._run_experts(x_ND, counts_E, extend, getattr(meta, "padded", False), gate_N)
            with record_function("moe.combine"):
                y_TD = self.dispatcher.combine(y_ND, meta, x.dtype, wires[1], self.a2a_waiter,
                                               weighted=not self.gates_in_experts)
            if self.shared_experts is not None and not self.shared_run_outside:
                with record_function("moe.shared_experts"):
                    y_TD = y_TD + self.shared_experts(x_TD)
        self._record(routing, meta, losses)
        return y_TD.reshape(shape)

    def _run_experts(self, x_ND, counts, extend, padded=False, gate_N=None):
        if self.etp_group is None:
            return self.experts(x_ND, counts, extend, padded, gate_N=gate_N)
        # the layout changes here: rows gathered over the etp group and back (it exchanges
        # the counts on the host anyway, so the kept rows are cut off here)
        from .expert_tp import tensor_parallel_experts
        if padded:
            k = int(counts.sum())
            y_kD = tensor_parallel_experts(self.experts, x_ND[:k], counts, extend, self.etp_group,
                                           None if gate_N is None else gate_N[:k])
            return pad_rows(y_kD, x_ND.shape[0])
        return tensor_parallel_experts(self.experts, x_ND, counts, extend, self.etp_group, gate_N)

    def _overlapped(self) -> bool:
        """The chunked, overlapped exchange (moe/chunked_a2a.py): d > 1, or d = 1 with a timeline
        attached (one chunk: the same exchanges as dispatch/combine, recorded)."""
        return self.ep_group is not None and not isinstance(self.dispatcher, LocalDispatcher) \
            and self.dispatch == "flat" and (self.a2a_overlap_degree > 1 or self.timeline is not None)

    def _overlapped_forward(self, x_TD, routing, out_dtype, wires):
        from .chunked_a2a import overlapped_experts
        shared = None
        if self.shared_experts is not None and not self.shared_run_outside:
            shared = lambda: self.shared_experts(x_TD)  # noqa: E731 - runs while dispatch flies
        with record_function("moe.overlapped_experts"):
            y_TD, meta, shared_TD = overlapped_experts(
                self.dispatcher, x_TD, routing, self._run_experts, self.a2a_overlap_degree,
                out_dtype, in_flight=shared, timeline=self.timeline, wires=wires,
                release=self.experts_release, gated=self.gates_in_experts)
        return (y_TD if shared_TD is None else y_TD + shared_TD), meta

    def set_dropless_eval(self) -> None:
        """Eval-mode forwards keep every assignment (no capacity factor, no fixed capacity):
        what inference wants (trainer.generate, trainer.evaluate). Token choice only."""
        if self.router.config.kind != "token_choice":
            raise ValueError("dropless routing needs token choice: expert choice (moe.router="
                             "'expert_choice') picks a fixed number of tokens per expert")
        self.router.config = dataclasses.replace(self.router.config, eval_capacity_factor=None,
                                                 expert_capacity=None)

    def set_experts_release(self, release) -> None:
        """release(): called when the chunked overlap (a2a_overlap_degree > 1) is done with
        the experts, once after the forward's chunks and once after the backward's, so their
        gathered weights can be held across the chunks and freed then (ZeRO-3 gathers them once
        per layer and direction: parallel/data_parallel/fsdp.py). None: nothing to do."""
        self.experts_release = release

    def set_a2a_waiter(self, waiter) -> None:
        """Issue this layer's expert all-to-alls (dispatch, combine, and their backward)
        asynchronously and wait for each through waiter(work) (None: blocking). parallel/
        interleave.py's waiter runs another micro-batch's work meanwhile (parallel.a2a_overlap
        = 1f1b); the chunked in-layer overlap keeps its own waits, so it is refused with one."""
        if waiter is not None and self.a2a_overlap_degree > 1:
            raise ValueError(f"a2a_overlap_degree={self.a2a_overlap_degree} (moe.a2a_overlap_degree) "
                             f"with parallel.a2a_overlap=1f1b: use one of the two overlaps")
        self.a2a_waiter = waiter

    def set_timeline(self, timeline) -> None:
        """Record this layer's exchanges and expert chunks on `timeline` (None: stop)."""
        if timeline is not None and self.dispatch != "flat":
            raise ValueError("the all-to-all timeline records the flat dispatch's exchanges; "
                             "profile with moe.dispatch=flat (the hierarchical hops are not drawn)")
        self.timeline = timeline

    def _record(self, routing, meta, losses: dict) -> None:
        self.aux_losses = losses
        z = losses["z_loss"] * self.z_loss_coef
        lb = losses.get("load_balance")
        self.aux_loss = z if lb is None else torch.add(z, lb, alpha=self.aux_loss_coef)
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
        if self.a2a_overlap_degree > 1:
            s += f", a2a_overlap_degree={self.a2a_overlap_degree}"
        if self.dispatch_dtype != "auto":
            s += f", dispatch_dtype={self.dispatch_dtype}"
        if self.dispatch != "flat":
            s += f", dispatch={self.dispatch}"
        if self.router.config.max_nodes is not None:
            s += f", max_nodes={self.router.config.max_nodes}"
        if self.gates_in_experts:
            s += ", gates_in_experts=True"
        return s + (", force_balance=True (BENCHMARK ONLY: routing ignored)"
                    if self.force_balance else "")

    def routing_summary(self) -> str:
        """One line with every routing semantic of this layer (printed by train.py at start)."""
        r = self.router.config
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
        if r.router_bias:
            parts.append("router_bias")
        if self.shared_experts is not None:
            gated = self.shared_experts.gate is not None
            parts.append("shared experts" + (" (sigmoid-gated)" if gated else ""))
        if self.replica_slots:
            parts.append(f"replica_slots={self.replica_slots}")
        if self.a2a_overlap_degree > 1:
            parts.append(f"a2a_overlap_degree={self.a2a_overlap_degree}")
        if self.dispatch_dtype != "auto":
            parts.append(f"dispatch_dtype={self.dispatch_dtype}")
        if self.dispatch != "flat":
            parts.append(f"dispatch={self.dispatch}")
        if r.max_nodes is not None:
            parts.append(f"max_nodes={r.max_nodes}" + (f" of the experts' {r.expert_nodes} nodes"
                                                       if r.expert_nodes > 1 else ""))
        if self.gates_in_experts:
            parts.append("gates in the experts")
        if self.force_balance:
            parts.append("FORCE-BALANCED (benchmark only: routing ignored)")
        return ", ".join(parts)
