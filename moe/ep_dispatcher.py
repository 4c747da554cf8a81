"""Expert-parallel dispatcher: token rows travel to the rank that holds their expert.

Shapes: T tokens, D model dim, A assignments kept on this rank, E global experts,
L = E/P local experts, P ranks of the expert-parallel group, N rows received here,
R replica slots per rank, W = L + R expert slots per rank, X flattened weights of one expert.

Each rank routes its own tokens (capacity drops are decided per routing group before any
exchange, so they are the same as on one process) and sorts its assignments by global expert
id. The ranks then share their [E] counts (one all_to_all_single of a [P, E] table: every
rank gets every source's counts), and each computes the same `moe.placement` from the global
counts: with replica_slots R > 0 the hottest experts get replicas on the least-loaded ranks
and their rows are split between the copies (R = 0: every row goes to its owner). Rows are
re-sorted by destination slot and exactly the routed rows are exchanged (no padding).
Received rows arrive ordered (source rank, slot); they are permuted to (slot, source rank)
so each slot sees one contiguous slice, and permuted back before the return exchange.

The host waits for the device once per layer forward: the [P, E] count table, copied to the
host after its exchange (the split sizes must be known there). Everything the host derives
from it (placement, routes, splits) is numpy arithmetic (moe/placement.py); the permutations
are computed on the device from a small table copied there; backward reuses the forward's
splits and permutes by gathers with the inverse known.

Replica weights are not state: `expert_weights` fetches them from their owners in every
forward through the differentiable all-to-all, so the backward of that exchange sends each
replica's weight gradient back to its owner, where the gather's backward adds it to the
owner's gradient. The optimizer only ever sees owned experts, replicas are fresh every step
and checkpoints hold no replica. The only distributed calls are in moe/all_to_all.py (the one
primitive moe/ owns).
"""
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .all_to_all import CollectiveCall, all_to_all, exchange_counts
from .dispatcher import (DispatchMeta, LocalDispatcher, gather_sorted, permute_rows, row_gates,
                         sort_by_expert, sorted_meta, weighted_combine)
from .nodes import one_node
from .placement import Placement, plan_placement, route_rows
from .routing import Routing

EXPERT_PARAM_ATTR = "_moe_expert"  # set True on parameters that hold experts
# every exchange of a dispatch and its combine, forward then backward, as they run
# (moe/all_to_all.py CollectiveCall; replica weights' fetch, expert_weights, is not listed:
# the planner does not model replicas)
FLAT_CALLS = (
    CollectiveCall("[P, E] int64 count table", "forward", "group", ("P", "E", 8)),
    CollectiveCall("rows to their experts", "forward", "group", ("A", "d")),
    CollectiveCall("expert outputs back", "forward", "group", ("N", "c")),
    CollectiveCall("the outputs' gradients", "backward", "group", ("A", "b")),
    CollectiveCall("the rows' gradients", "backward", "group", ("N", "b")),
)
# moe.gates_in_experts adds: each sent row's gate to its expert, and the gates' gradients back
FLAT_GATE_CALLS = FLAT_CALLS + (
    CollectiveCall("fp32 gate of each row", "forward", "group", ("A", 4)),
    CollectiveCall("the gates' gradients", "backward", "group", ("N", 4)),
)


@dataclass(frozen=True)
class SendPlan:
    x_AD: torch.Tensor         # this rank's kept rows in send order (destination, slot)
    local: DispatchMeta        # their tokens, gates and slots, in the same order (then the
                               # dropped assignments, which are not sent)
    table_PPW: np.ndarray      # int64 [P, P, W] on the host: rows source -> destination slot
    placement: Placement       # the same on every rank of the group


@dataclass(frozen=True)
class Exchange:
    send_splits: tuple         # rows sent to each rank (P)
    recv_splits: tuple         # rows received from each rank (P)
    perm_N: torch.Tensor       # long [N]: received (source, slot) order -> (slot, source)
    unperm_N: torch.Tensor     # long [N]: its inverse
    counts_L: tuple            # rows per local slot (owned, then replicas)


@dataclass(frozen=True)
class EPDispatchMeta:
    local: DispatchMeta        # this rank's assignments, in send order (destination slot)
    send_splits: tuple         # rows sent to each rank (P)
    recv_splits: tuple         # rows received from each rank (P)
    unperm_N: torch.Tensor     # long [N]: (slot, source) order -> (source, slot) order (None
                               # when the exchange ran in chunks: moe/chunked_a2a.py)
    counts_L: tuple            # rows per local slot after the exchange (owned, then replicas)
    placement: Placement       # the same on every rank of the group
    hops: object = None        # moe/hierarchical.Hops under node-aware dispatch, else None
    perm_N: torch.Tensor = None  # long [N]: unperm_N's inverse (the dispatch's permutation)

    @property
    def rank_rows(self) -> torch.Tensor:
        """long [P]: rows each rank of the group received (after replication)."""
        return torch.tensor(self.placement.rank_rows, dtype=torch.long)

    @property
    def rank_rows_unreplicated(self):
        """long [P]: rows each rank would have received without replicas (its owned
        experts'); None when no rank holds a replica (then it is rank_rows)."""
        if not any(self.placement.replicas):
            return None
        return torch.tensor(self.placement.owner_rows, dtype=torch.long)


def source_to_expert_order(recv_PL: torch.Tensor, N: int = None) -> torch.Tensor:
    """Permutation turning rows laid out (source p, expert l) into (expert l, source p).

    recv_PL[p, l] rows came from rank p for local expert l. Returns long [N] with
    out[i] = index in the received buffer of the i-th row in (l, p) order. N: the total,
    when the host knows it (no read of recv_PL's sum then).
    """
    P, L = recv_PL.shape
    flat = recv_PL.reshape(-1)
    start_PL = (torch.cumsum(flat, 0) - flat).reshape(P, L)
    cnt_LP, start_LP = recv_PL.t().reshape(-1), start_PL.t().reshape(-1)
    N = int(flat.sum()) if N is None else N
    out_start_LP = torch.cumsum(cnt_LP, 0) - cnt_LP
    shift = torch.repeat_interleave(start_LP - out_start_LP, cnt_LP, output_size=N)
    return torch.arange(N, device=recv_PL.device) + shift


class ExpertParallelDispatcher:
    """Dispatch to the experts spread over `group`; rank r of P owns [r*L, (r+1)*L) and has
    `replica_slots` more slots for replicas of hot experts (moe/placement.py)."""

    def __init__(self, num_experts: int, group, replica_slots: int = 0):
        self.num_experts = num_experts
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local = num_experts // self.world
        self.replica_slots = replica_slots

    def plan(self, x_TD: torch.Tensor, routing: Routing) -> "SendPlan":
        """Route this rank's assignments: exchange the count tables, place experts and
        replicas, gather the rows in send order (destination rank, then slot)."""
        P, r = self.world, self.rank
        order_A, counts_E = sort_by_expert(routing, self.num_experts)
        mine_PE = counts_E.to(x_TD.device).expand(P, -1)
        counts_PE = exchange_counts(mine_PE, self.group).cpu().numpy()  # the host's one wait
        placement = plan_placement(counts_PE.sum(0), P, self.replica_slots)
        routes = route_rows(placement, counts_PE)
        kept = int(counts_PE[r].sum())
        if self.replica_slots:  # rows of a replicated expert may go to several ranks
            g, n = zip(*routes.runs_of(r)) if kept else ((), ())
            g_A = torch.as_tensor(np.repeat(np.asarray(g, dtype=np.int64), n), device=order_A.device)
            first = order_A[:kept][torch.sort(g_A, stable=True).indices]
            order_A = torch.cat([first, order_A[kept:]])
        local = sorted_meta(routing, order_A, counts_E)
        x_AD = gather_sorted(x_TD, local)
        table_PPW = routes.table.reshape(P, P, -1)
        return SendPlan(x_AD[:kept] if routing.dropped else x_AD, local, table_PPW, placement)

    def exchange_plan(self, table_PPW, placement: Placement, device=None) -> "Exchange":
        """Splits, permutations and slot counts of one exchange whose rows per (source,
        destination, slot) are `table_PPW` (int64 [P, P, W] on the host: the whole dispatch,
        or one chunk of it); the permutations are made on `device`."""
        r = self.rank
        table_PPW = np.asarray(table_PPW)
        send_splits = table_PPW[r].sum(1).tolist()
        recv_PW = table_PPW[:, r, :]
        recv_splits = recv_PW.sum(1).tolist()
        N = sum(recv_splits)
        perm_N = source_to_expert_order(torch.tensor(recv_PW.tolist(), device=device), N)
        unperm_N = torch.empty_like(perm_N).scatter_(0, perm_N, torch.arange(N, device=perm_N.device))
        slots = self.num_local + len(placement.replicas[r])
        return Exchange(tuple(send_splits), tuple(recv_splits), perm_N, unperm_N,
                        tuple(recv_PW.sum(0).tolist()[:slots]))

    def dispatch(self, x_TD: torch.Tensor, routing: Routing, wire=None, waiter=None):
        """-> (x_ND, counts_L, meta). The exchange needs its split sizes on the host, so
        counts_L (rows per local slot) are Python ints here. wire: the rows' format on the
        wire (moe/wire.py), None: as they are. waiter: moe/all_to_all.py's (the rows'
        exchanges both ways are waited for through it), None: blocking."""
        sp = self.plan(x_TD, routing)
        ex = self.exchange_plan(sp.table_PPW, sp.placement, x_TD.device)
        x_ND = all_to_all(sp.x_AD, list(ex.recv_splits), list(ex.send_splits), self.group, wire, waiter)
        meta = EPDispatchMeta(sp.local, ex.send_splits, ex.recv_splits, ex.unperm_N,
                              ex.counts_L, sp.placement, perm_N=ex.perm_N)
        return permute_rows(x_ND, ex.perm_N, ex.unperm_N), list(ex.counts_L), meta

    def expert_weights(self, params: tuple, meta: EPDispatchMeta) -> tuple:
        """Each of `params` (w1, w2, ... with E_local rows, None allowed) with this rank's
        replicas appended, fetched from their owners by one differentiable all-to-all.

        Owner o sends, to each rank c in order, its experts in c's replica list (ascending,
        so grouped by owner), which arrive on c in slot order. In backward the reverse
        exchange returns each replica's gradient to its owner and the index_select backward
        adds it to the owner's rows. Collective when any rank holds a replica (the
        placement is the same everywhere, so all ranks agree on whether to call it)."""
        pl, L, r = meta.placement, self.num_local, self.rank
        if not any(pl.replicas):
            return params
        present = [p for p in params if p is not None]
        flat_LX = torch.cat([p.reshape(L, -1) for p in present], 1)
        send_idx = [e - r * L for c in range(self.world) for e in pl.replicas[c] if e // L == r]
        send_splits = [sum(e // L == r for e in pl.replicas[c]) for c in range(self.world)]
        recv_splits = [sum(e // L == o for e in pl.replicas[r]) for o in range(self.world)]
        idx = torch.tensor(send_idx, dtype=torch.long, device=flat_LX.device)
        rep_RX = all_to_all(flat_LX.index_select(0, idx), recv_splits, send_splits, self.group)
        widths = [p[0].numel() for p in present]
        reps = iter(rep_RX.split(widths, 1))
        return tuple(None if p is None else
                     torch.cat([p, next(reps).reshape(-1, *p.shape[1:]).to(p.dtype)])
                     for p in params)

    def sent_gates(self, meta: EPDispatchMeta) -> torch.Tensor:
        """fp32 [A]: the gates of the rows this rank sends, in send order (differentiable)."""
        return row_gates(meta.local)[:sum(meta.send_splits)]

    def gates(self, meta: EPDispatchMeta, waiter=None) -> torch.Tensor:
        """fp32 [N]: the gate of each row this rank's experts received, in the rows' order
        (moe.gates_in_experts): the sent gates travel as the rows did (one all_to_all, fp32;
        its backward returns their gradients to the senders)."""
        g_N = all_to_all(self.sent_gates(meta).view(-1, 1), list(meta.recv_splits),
                         list(meta.send_splits), self.group, None, waiter).view(-1)
        return permute_rows(g_N, meta.perm_N, meta.unperm_N)

    def combine(self, y_ND: torch.Tensor, meta: EPDispatchMeta, out_dtype, wire=None,
                waiter=None, weighted: bool = True) -> torch.Tensor:
        y_src_ND = permute_rows(y_ND, meta.unperm_N, meta.perm_N)
        y_AD = all_to_all(y_src_ND, list(meta.send_splits), list(meta.recv_splits), self.group,
                          wire, waiter)
        return weighted_combine(y_AD, meta.local, out_dtype, weighted)


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
    R, L = layer.replica_slots, E // P
    if R and P == 1:
        raise ValueError(f"replica_slots={R} (moe.replica_slots) needs an expert-parallel group of "
                         f"more than one rank; set it to 0 or use parallel.ep > 1")
    if layer.a2a_overlap_degree > 1 and P == 1:
        raise ValueError(f"a2a_overlap_degree={layer.a2a_overlap_degree} (moe.a2a_overlap_degree) "
                         f"overlaps the expert-parallel all-to-all, but the ep group has one rank; "
                         f"set it to 1 or use parallel.ep > 1")
    if layer.dispatch == "hierarchical" and P == 1:
        raise ValueError("dispatch='hierarchical' (moe.dispatch) sends tokens between nodes of the "
                         "expert-parallel group, but it has one rank; use dispatch='flat' or "
                         "parallel.ep > 1")
    if layer.dispatch == "hierarchical" and layer.a2a_overlap_degree > 1:
        raise ValueError(f"dispatch='hierarchical' with a2a_overlap_degree="
                         f"{layer.a2a_overlap_degree}: the chunked overlap runs the flat exchange; "
                         f"set moe.a2a_overlap_degree=1 or moe.dispatch=flat")
    if R > E - L:
        raise ValueError(f"replica_slots={R} (moe.replica_slots) exceeds the {E - L} experts a rank "
                         f"does not own at ep={P}; use at most {E - L}")
    if layer.experts.num_local != E:
        raise ValueError(f"layer.experts holds {layer.experts.num_local} experts, expected all "
                         f"{E}: shard a layer that still has its full weights")
    return P, r


def shard_layer_experts(layer, ep_group) -> None:
    """Keep experts [r*E/P, (r+1)*E/P) of `layer`, install the all-to-all dispatcher.

    The layer must hold full weights (identical on every rank, e.g. same seed); they are
    sliced in place, so build optimizers afterwards. With `layer.replica_slots` > 0 each rank
    also serves replicas of hot experts (weights fetched from their owners every forward, never
    stored). Expert parameters are marked with
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
        layer.dispatcher = ExpertParallelDispatcher(layer.num_experts, ep_group,
                                                    layer.replica_slots)
        if layer.dispatch == "hierarchical":  # one node until set_expert_nodes says otherwise
            layer.set_expert_nodes(one_node(P))
