"""MoELayer: router -> dispatcher -> experts -> combine, a drop-in for a dense FFN.

Shapes: T tokens, D model dim, F ffn dim, E experts, K top-k, G routing groups (all leading
dims but the last two), S tokens per group (dim -2 of the input).
"""
import torch
import torch.nn as nn
from torch.profiler import record_function  # named ranges for traces; ~free when not profiling

from .dispatcher import LocalDispatcher
from .experts import DenseFFN, ExpertBank, check_activation
from .router import ROUTER_KINDS, Router
from .stats import RoutingStats


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
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
            raise ValueError(f"{name}={cf!r} must be a positive number, or None for dropless")
    if router not in ROUTER_KINDS:
        raise ValueError(f"router={router!r} is not supported; use one of {ROUTER_KINDS}")
    if num_shared_experts < 0:
        raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")


class MoELayer(nn.Module):
    """Sparse FFN: y = sum over the token's selected experts of gate_e * expert_e(x).

    top_k=1: gate = router probability p_e (Switch). top_k>=2: the k selected probabilities
    renormalized to sum to 1 (GShard, Mixtral). capacity_factor=None is dropless; a float caps
    each expert at ceil(cf * S * K / E) assignments per routing group (a sequence), dropped
    assignments contribute zero. `aux_loss` holds the weighted aux losses of the last forward,
    `last_stats` its routing statistics.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 2,
                 capacity_factor=None, activation: str = "gelu", ep_group=None, *,
                 router: str = "token_choice", eval_capacity_factor="same",
                 aux_loss_coef: float = 1e-2, z_loss_coef: float = 1e-3, jitter: float = 0.0,
                 num_shared_experts: int = 0, shared_d_ff=None, expert_bias: bool = False,
                 init_std: float = 0.02, out_init_std=None):
        super().__init__()
        eval_cf = capacity_factor if eval_capacity_factor == "same" else eval_capacity_factor
        _check_args(d_model, d_ff, num_experts, top_k, capacity_factor, eval_cf, router,
                    num_shared_experts)
        check_activation(activation)
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_cf
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = Router(d_model, num_experts, top_k, router, jitter, init_std)
        self.experts = ExpertBank(num_experts, d_model, d_ff, activation, expert_bias,
                                  init_std, out_init_std)
        self.shared_experts = None
        if num_shared_experts > 0:
            self.shared_experts = DenseFFN(d_model, (shared_d_ff or d_ff) * num_shared_experts,
                                           activation, expert_bias, init_std)
        self.dispatcher = LocalDispatcher(num_experts)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        x_TD = x_GSD.reshape(-1, D)
        with record_function("moe.dispatch"):
            x_ND, counts_E, meta = self.dispatcher.dispatch(x_TD, routing)
        with record_function("moe.experts"):
            y_ND = self.experts(x_ND, counts_E)
        with record_function("moe.combine"):
            y_TD = self.dispatcher.combine(y_ND, meta, x.dtype)
        if self.shared_experts is not None:
            with record_function("moe.shared_experts"):
                y_TD = y_TD + self.shared_experts(x_TD)
        self._record(routing)
        return y_TD.reshape(shape)

    def _record(self, routing) -> None:
        self.aux_losses = routing.aux_losses
        coefs = {"load_balance": self.aux_loss_coef, "z_loss": self.z_loss_coef}
        self.aux_loss = sum(coefs[k] * v for k, v in routing.aux_losses.items())
        with torch.no_grad():
            self.last_stats = RoutingStats(routing.routed_E.detach(), routing.kept_E.detach(),
                                           routing.num_tokens, self.top_k, routing.entropy)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, capacity_factor={self.capacity_factor}")
