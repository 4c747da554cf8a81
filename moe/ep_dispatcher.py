"""Expert-parallel dispatcher: token rows travel to the rank that holds their expert.

Shapes: T tokens, D model dim, A assignments kept on this rank, E global experts,
L = E/P local experts, P ranks of the expert-parallel group, N rows received here.

Each rank routes its own tokens (capacity drops are decided per routing group before any
exchange, so they are the same as on one process), sorts its assignments by global expert
id (which is also by destination rank, since rank r owns experts [r*L, (r+1)*L)),
exchanges the [P, L] count table, then exactly the routed rows (no padding). Received rows
arrive ordered (source rank, local expert); they are permuted to (local expert, source
rank) so each local expert sees one contiguous slice, and permuted back before the return
exchange. Rank-agnostic otherwise: the only distributed calls are in moe/all_to_all.py (the one primitive moe/ owns).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .all_to_all import CommCounter, all_to_all, exchange_counts

from .dispatcher import DispatchMeta, LocalDispatcher, gather_sorted, sort_by_expert, weighted_combine
from .routing import Routing

EXPERT_PARAM_ATTR = "_moe_expert"  # set True on parameters that hold experts


@dataclass(frozen=True)
class EPDispatchMeta:
    local: DispatchMeta        # this rank's assignments, sorted by global expert
    send_splits: tuple         # rows sent to each rank (P)
    recv_splits: tuple         # rows received from each rank (P)
    unperm_N: torch.Tensor     # long [N]: (expert, source) order -> (source, expert) order
    counts_L: tuple            # rows per local expert after the exchange


def source_to_expert_order(recv_PL: torch.Tensor) -> torch.Tensor:
    """Permutation turning rows laid out (source p, expert l) into (expert l, source p).

    recv_PL[p, l] rows came from rank p for local expert l. Returns long [N] with
    out[i] = index in the received buffer of the i-th row in (l, p) order.
    """
    P, L = recv_PL.shape
    flat = recv_PL.reshape(-1)
    start_PL = (torch.cumsum(flat, 0) - flat).reshape(P, L)
    cnt_LP, start_LP = recv_PL.t().reshape(-1), start_PL.t().reshape(-1)
    N = int(flat.sum())
    out_start_LP = torch.cumsum(cnt_LP, 0) - cnt_LP
    shift = torch.repeat_interleave(start_LP - out_start_LP, cnt_LP, output_size=N)
    return torch.arange(N, device=recv_PL.device) + shift


class ExpertParallelDispatcher:
    """Dispatch to the experts spread over `group`; rank r of P owns [r*E/P, (r+1)*E/P)."""

    def __init__(self, num_experts: int, group, counter: CommCounter = None):
        self.num_experts = num_experts
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local = num_experts // self.world
        self.counter = counter if counter is not None else CommCounter()

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, host_counts: bool = True):
        """host_counts is accepted for the dispatcher interface; the exchange needs the
        split sizes on the host, so counts_L are always Python ints here."""
        P, L = self.world, self.num_local
        order_A, counts_E = sort_by_expert(routing, self.num_experts)
        x_AD, token_A, gate_A, slot_A = gather_sorted(x_TD, routing, order_A)
        local = DispatchMeta(token_A, gate_A, slot_A, routing.slots_per_token,
                             routing.num_tokens, tuple(counts_E))
        send_PL = torch.tensor(counts_E, dtype=torch.long, device=x_TD.device).view(P, L)
        recv_PL = exchange_counts(send_PL, self.group, self.counter)
        send_splits = [sum(counts_E[p * L:(p + 1) * L]) for p in range(P)]
        recv_rows = recv_PL.tolist()
        recv_splits = [sum(row) for row in recv_rows]
        x_ND = all_to_all(x_AD, recv_splits, send_splits, self.group, self.counter)
        perm_N = source_to_expert_order(recv_PL)
        unperm_N = torch.empty_like(perm_N)
        unperm_N[perm_N] = torch.arange(perm_N.numel(), device=perm_N.device)
        counts_L = tuple(sum(recv_rows[p][l] for p in range(P)) for l in range(L))
        meta = EPDispatchMeta(local, tuple(send_splits), tuple(recv_splits), unperm_N, counts_L)
        return x_ND[perm_N], list(counts_L), meta

    def combine(self, y_ND: torch.Tensor, meta: EPDispatchMeta, out_dtype) -> torch.Tensor:
        y_src_ND = y_ND[meta.unperm_N]
        y_AD = all_to_all(y_src_ND, list(meta.send_splits), list(meta.recv_splits),
                          self.group, self.counter)
        return weighted_combine(y_AD, meta.local, out_dtype)


def check_shardable(layer, ep_group) -> tuple:
    """(P, r) of `ep_group` if `layer` can be sharded over it; else a clear error, before any
    collective (the one check behind MoELayer(ep_group=...) and parallel.apply_expert_parallel)."""
    if ep_group is None:
        raise ValueError("ep_group is None: pass the expert-parallel ProcessGroup "
                         "(or do not call set_ep_group for a one-process layer)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed initialized "
                           "(init_process_group) before the layer is sharded")
    if layer.ep_group is not None:
        raise ValueError("this MoELayer is already expert-parallel; shard it only once "
                         "(build a fresh layer to change the expert-parallel group)")
    P, r = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    if r < 0:
        raise ValueError(f"this rank (global {dist.get_rank()}) is not a member of ep_group; "
                         "every rank must pass the expert-parallel group that contains it")
    E = layer.num_experts
    if E % P:
        raise ValueError(f"num_experts={E} is not divisible by the expert-parallel size {P}; "
                         "choose ep dividing num_experts")
    if layer.experts.num_local != E:
        raise ValueError(f"layer.experts holds {layer.experts.num_local} experts, expected all "
                         f"{E}: shard a layer that still has its full weights")
    return P, r


def shard_layer_experts(layer, ep_group, counter: CommCounter = None) -> None:
    """Keep experts [r*E/P, (r+1)*E/P) of `layer`, install the all-to-all dispatcher.

    The layer must hold full weights (identical on every rank, e.g. same seed); they are
    sliced in place, so build optimizers afterwards. Expert parameters are marked with
    `EXPERT_PARAM_ATTR`. Errors (E % P, wrong group) are raised before any collective.
    """
    P, r = check_shardable(layer, ep_group)
    L = layer.num_experts // P
    for name, p in layer.experts.named_parameters(recurse=False):
        # slice .data so the Parameter objects (and any hooks/attributes) stay the same
        p.data = p.data[r * L:(r + 1) * L].clone()
        p.grad = None
        setattr(p, EXPERT_PARAM_ATTR, True)
    layer.ep_group = ep_group
    if P == 1:
        layer.dispatcher = LocalDispatcher(layer.num_experts)
    else:
        layer.dispatcher = ExpertParallelDispatcher(layer.num_experts, ep_group, counter)
