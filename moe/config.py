"""RoutingConfig: every setting that decides which experts a token goes to, with which gate,
and what the routing's losses average over. Frozen, validated once, consumed by the Router
(and the balance loss); `MoELayer(...)` keywords and the `moe.*` config fields build it.

Shapes: E experts, K top-k.
"""
from dataclasses import dataclass, fields
from typing import Optional

import torch

from .capacity import check_capacity_factor
from .scoring import SCORE_FUNCS, check_group_args

ROUTER_KINDS = ("token_choice", "expert_choice")
BALANCE_LOSSES = ("sequence", "micro_batch", "global_batch")


def routes_per_sequence(kind: str, capacity_factor=None, eval_capacity_factor="same",
                        expert_capacity=None) -> bool:
    """True when a token's experts depend on the other tokens of its routing group (a
    capacity, in training or eval, or expert choice): such a layer must be handed whole
    sequences. Dropless token choice decides each token alone, so any split of the tokens
    over ranks routes every token as one process does (and its sequence balance loss sums
    the sequences' statistics over the ranks holding their parts: moe/losses.py)."""
    if isinstance(eval_capacity_factor, str) and eval_capacity_factor.lower() == "same":
        eval_capacity_factor = capacity_factor
    return kind != "token_choice" or capacity_factor is not None or \
        eval_capacity_factor is not None or expert_capacity is not None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int to Python


def as_dtype(value, name: str):
    """None, a torch.dtype, or its name ("float32") -> torch.dtype or None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    dt = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"{name}={value!r} is not a floating dtype; use e.g. 'float32' or None")
    return dt


@dataclass(frozen=True)
class RoutingConfig:
    """Field names are MoELayer's keywords (`kind` is its `router=`). After construction the
    values are resolved: eval_capacity_factor "same" -> capacity_factor, norm_topk_prob None ->
    top_k >= 2, topk_group None -> n_group, dtypes given by name -> torch.dtype."""
    num_experts: int
    top_k: int = 2
    kind: str = "token_choice"             # token_choice | expert_choice
    capacity_factor: Optional[float] = None  # None: dropless; cap ceil(cf*S*K/E) per group
    eval_capacity_factor: object = "same"  # the capacity factor in eval mode
    expert_capacity: Optional[int] = None  # a fixed capacity per expert and group instead
    jitter: float = 0.0                    # multiplicative input noise in training (Switch)
    score_func: str = "softmax"            # softmax | sigmoid (DeepSeek-V3)
    norm_topk_prob: Optional[bool] = None  # renormalise the k gates to sum to 1
    n_group: int = 1                       # group-limited top-k (DeepSeek-V3)
    topk_group: Optional[int] = None
    routed_scaling_factor: float = 1.0     # multiplies the gates after normalisation
    router_bias: bool = False              # a learned bias [E] on the logits
    logits_dtype: object = None            # pin the logits' dtype (None: >= fp32)
    score_dtype: object = None             # pin the scores' dtype
    force_balance: bool = False            # BENCHMARKING ONLY: assignments dealt round-robin
    balance_loss: str = "sequence"         # sequence | micro_batch | global_batch
    max_nodes: Optional[int] = None        # a token's top-k experts lie on <= this many nodes
    expert_nodes: int = 1                  # nodes the experts span (set by the layout, not users)

    def __post_init__(self):
        self._check_basic()
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen)
        if self.eval_capacity_factor == "same":
            set_("eval_capacity_factor", self.capacity_factor)
        check_capacity_factor(self.eval_capacity_factor, "eval_capacity_factor")
        set_("topk_group", check_group_args(self.num_experts, self.top_k, self.n_group,
                                            self.topk_group))
        self._check_options()
        self._check_nodes()
        # expert choice has no per-token gates to renormalise (resolving to True there would
        # make the resolved config fail its own check on dataclasses.replace)
        set_("norm_topk_prob", (self.top_k > 1 and self.kind == "token_choice")
             if self.norm_topk_prob is None else bool(self.norm_topk_prob))
        set_("routed_scaling_factor", float(self.routed_scaling_factor))
        set_("logits_dtype", as_dtype(self.logits_dtype, "logits_dtype"))
        set_("score_dtype", as_dtype(self.score_dtype, "score_dtype"))

    @property
    def routes_per_sequence(self) -> bool:
        """See routes_per_sequence()."""
        return routes_per_sequence(self.kind, self.capacity_factor, self.eval_capacity_factor,
                                   self.expert_capacity)

    def _check_basic(self) -> None:
        E, K = self.num_experts, self.top_k
        if not _is_int(E) or E < 1:
            raise ValueError(f"num_experts={E!r} must be a positive integer")
        if not _is_int(K) or K < 1:
            raise ValueError(f"top_k={K!r} must be an integer >= 1")
        if K > E:
            raise ValueError(f"top_k={K} is larger than num_experts={E}; use top_k <= num_experts")
        check_capacity_factor(self.capacity_factor, "capacity_factor")
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"router={self.kind!r} is not supported; use one of {ROUTER_KINDS}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r} is not supported; use one of "
                             f"{SCORE_FUNCS}")
        if self.norm_topk_prob not in (None, True, False):
            raise ValueError(f"norm_topk_prob={self.norm_topk_prob!r} must be None (renormalise "
                             f"iff top_k >= 2), True or False")

    def _check_options(self) -> None:
        rsf, cap = self.routed_scaling_factor, self.expert_capacity
        if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not rsf > 0:
            raise ValueError(f"routed_scaling_factor={rsf!r} must be a positive number")
        if cap is not None:
            if not _is_int(cap) or cap < 1:
                raise ValueError(f"expert_capacity={cap!r} must be a positive integer or None")
            if self.capacity_factor is not None:
                raise ValueError(f"expert_capacity={cap} and capacity_factor="
                                 f"{self.capacity_factor} both set the capacity; pass only one")
        if self.kind == "expert_choice":
            self._check_expert_choice()
        if self.balance_loss not in BALANCE_LOSSES:
            raise ValueError(f"balance_loss={self.balance_loss!r} is not supported; use one of "
                             f"{BALANCE_LOSSES}")
        if self.force_balance not in (True, False):
            raise ValueError(f"force_balance={self.force_balance!r} must be True or False")
        if self.force_balance and self.kind != "token_choice":
            raise ValueError(f"force_balance=True spreads token-choice assignments; router="
                             f"{self.kind!r} is balanced by construction: use "
                             f"router='token_choice'")

    def _check_nodes(self) -> None:
        """Node limit (moe/scoring.py node_keep_mask). expert_nodes comes from the layout
        (dataclasses.replace), so max_nodes > expert_nodes is fine: the limit does not bind."""
        M, n, E = self.max_nodes, self.expert_nodes, self.num_experts
        if not _is_int(n) or n < 1 or E % n:
            raise ValueError(f"expert_nodes={n!r} must be an integer >= 1 dividing num_experts="
                             f"{E} (the layout sets it: nodes of the expert-parallel group)")
        if M is None:
            return
        if not _is_int(M) or M < 1:
            raise ValueError(f"max_nodes={M!r} must be None (no node limit) or an integer >= 1")
        if self.kind == "expert_choice":
            raise ValueError(f"max_nodes={M} limits each token's experts to some nodes, but "
                             f"router='expert_choice' lets experts pick tokens; use "
                             f"max_nodes=None or router='token_choice'")
        if n == 1 or M >= n:
            return
        if self.top_k > M * (E // n):
            raise ValueError(f"max_nodes={M}: top_k={self.top_k} is more than the {M * (E // n)} "
                             f"experts on {M} of the {n} expert nodes; raise max_nodes")
        if self.n_group > 1 and self.n_group % n:
            raise ValueError(f"max_nodes={M} with n_group={self.n_group} groups that do not lie "
                             f"inside the {n} expert nodes: the two limits together can leave "
                             f"fewer than top_k experts; use n_group a multiple of {n} (one "
                             f"group per node: n_group={n}) or max_nodes=None")

    def _check_expert_choice(self) -> None:
        if self.n_group > 1:
            raise ValueError(f"n_group={self.n_group} limits each token's experts to some groups, "
                             f"but router='expert_choice' lets experts pick tokens; use n_group=1 "
                             f"or router='token_choice'")
        if self.norm_topk_prob:
            raise ValueError("norm_topk_prob=True renormalises a token's top-k gates, which "
                             "router='expert_choice' does not have; leave it None")
        if self.balance_loss != "sequence":
            raise ValueError(f"balance_loss={self.balance_loss!r} needs token-choice routing; "
                             f"router='expert_choice' is balanced by construction and has no "
                             f"balance loss")

    @classmethod
    def field_names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))
