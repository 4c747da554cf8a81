"""Node-aware expert dispatch (moe.dispatch = hierarchical): a token crosses to a node once.

Shapes: T tokens, D model dim, A assignments this rank sends (send order: destination rank,
slot), U unique (node, token) rows this rank sends, P ranks of the ep group, W expert slots
per rank, n nodes, G = P / n ranks per node (moe/nodes.py), U1 / A1 rows / assignments a
proxy receives, N rows an expert rank receives.

Flat dispatch sends one row per assignment: a token routed to k experts on one remote node
crosses the network k times. Here (DeepSeek-V3's dispatch, DeepEP's internode kernels):
  hop 1  each token goes once to every node holding one of its experts, to the rank with the
         sender's local index there (its proxy), with the assignments it serves on that node
         (an int index into the rows sent, and the gate: fp32, differentiable);
  hop 2  the proxy fans the row out to the experts of its node, exactly the (destination,
         slot) rows of the flat dispatch: the expert ranks receive what they would have;
  combine: the expert outputs return to the proxy, which weighs them by their gates and sums
         each token's rows of its node (moe/dispatcher.weighted_combine), so one row per
         (token, node) crosses back; the sender adds its token's node rows.
Backward mirrors it: the proxy sums a token's gradient rows before they cross back.

Both hops are all_to_all_single calls on the ep group (a rank sends only to its proxies in hop
1 and only inside its node in hop 2; the other splits are zero). The rows are encoded once in
the wire format (moe/wire.py) and decoded on the expert rank: hop 2 forwards the encoded
bytes, so fp8 rows are quantized once, as in the flat dispatch. The expert ranks see the same
rows in the same order as flat dispatch, so capacity, dropless routing, replicas (rows of a
replica cross to the replica's node) and expert tensor parallelism need nothing here; only
the combine's summation order differs (a token's rows are summed per node, then over nodes).
"""
from dataclasses import dataclass

import numpy as np
import torch

from .all_to_all import CollectiveCall, all_to_all, exchange_counts, exchange_in, start_exchange
from .dispatcher import DispatchMeta, gather_sorted, permute_rows, weighted_combine
from .ep_dispatcher import EPDispatchMeta, ExpertParallelDispatcher, source_to_expert_order
from .nodes import ExpertNodes
from .wire import arrival_dtype, decode, encode

__all__ = ["HIERARCHICAL_CALLS", "HIERARCHICAL_GATE_CALLS", "HierarchicalDispatcher", "Hops",
           "proxy_table"]

# every exchange of a dispatch and its combine, forward then backward, as they run
# (moe/all_to_all.py CollectiveCall): hop 2 and its way back stay on the node; the rest may cross
HIERARCHICAL_CALLS = (
    CollectiveCall("[P, E] int64 count table", "forward", "group", ("P", "E", 8)),
    CollectiveCall("[P, 1] int64 hop-1 rows per proxy", "forward", "group", ("P", 8)),
    CollectiveCall("int32 hop-1 row index of each assignment", "forward", "group", ("A", 4)),
    CollectiveCall("fp32 gate of each assignment", "forward", "group", ("A", 4)),
    CollectiveCall("hop 1: unique (token, node) rows", "forward", "group", ("U", "d")),
    CollectiveCall("hop 2: rows to their experts", "forward", "node", ("A1", "d")),
    CollectiveCall("expert outputs back to the proxy", "forward", "node", ("N", "c")),
    CollectiveCall("the proxy's node sums back", "forward", "group", ("U1", "c")),
    CollectiveCall("the node sums' gradients", "backward", "group", ("U", "b")),
    CollectiveCall("the expert outputs' gradients", "backward", "node", ("A1", "b")),
    CollectiveCall("hop 2's gradients", "backward", "node", ("N", "b")),
    CollectiveCall("hop 1's gradients, summed at the proxy", "backward", "group", ("U1", "b")),
    CollectiveCall("the gates' gradients", "backward", "group", ("A1", 4)),
)
# moe.gates_in_experts adds: the proxy forwards each assignment's gate to its expert (beside
# hop 2's rows) and the gradients come back to it; its combine then weighs nothing
HIERARCHICAL_GATE_CALLS = HIERARCHICAL_CALLS + (
    CollectiveCall("fp32 gates to their experts", "forward", "node", ("A1", 4)),
    CollectiveCall("the experts' gate gradients", "backward", "node", ("N", 4)),
)


@dataclass(frozen=True)
class Hops:
    send1: tuple            # hop 1: unique rows this rank sends to each rank (its proxies)
    recv1: tuple            # hop 1: rows this rank receives as a proxy from each source
    fan_A1: torch.Tensor    # long [A1]: hop-2 rows in send order, as indices into hop 1's rows
    gate_A1: torch.Tensor   # fp32 [A1]: their gates (in the graph: the router's gradient)
    token_U: torch.Tensor   # long [U]: the token of each row this rank sent in hop 1


def proxy_table(table_PPW, nodes: ExpertNodes):
    """int64 [P, P, W]: rows each proxy sends to each (destination, slot) in hop 2: the rows of
    table_PPW[s, d, w] go through proxy(s, node of d). Host arithmetic (numpy; a torch table
    gives a torch table)."""
    table = np.asarray(table_PPW)
    P = table.shape[0]
    node_D = np.asarray(nodes.node_of_rank)
    proxy_SD = node_D[None, :] * nodes.ranks_per_node + (np.arange(P) % nodes.ranks_per_node)[:, None]
    dest_SD = np.broadcast_to(np.arange(P)[None, :], (P, P))
    out = np.zeros_like(table)
    np.add.at(out, (proxy_SD, dest_SD), table)
    return torch.from_numpy(out) if isinstance(table_PPW, torch.Tensor) else out


def _hop(x, out_splits, in_splits, group, waiter):
    """One exchange of x as it is, waited for through `waiter` (moe/all_to_all.py)."""
    return exchange_in(None, x, out_splits, in_splits, group, waiter=waiter)


class _TwoHops(torch.autograd.Function):
    """Unique rows -> proxies -> expert ranks, encoded once; backward sums at the proxy."""

    @staticmethod
    def forward(ctx, x_UD, hops, send2, recv2, group, wire, waiter):
        ctx.hops, ctx.splits2, ctx.group, ctx.wire, ctx.in_dtype = hops, (send2, recv2), group, wire, x_UD.dtype
        ctx.waiter = waiter
        fmt = None if wire is None or wire.forward == x_UD.dtype else wire.forward
        payload = x_UD if fmt is None else encode(x_UD, fmt)
        got1 = _hop(payload, hops.recv1, hops.send1, group, waiter)
        ctx.rows1 = got1.shape[0]
        fanned = got1.index_select(0, hops.fan_A1.to(got1.device))
        got2 = _hop(fanned, recv2, send2, group, waiter)
        if fmt is None:
            return got2
        return decode(got2, fmt, x_UD.shape[-1], arrival_dtype(x_UD, fmt))

    @staticmethod
    def backward(ctx, grad_ND):
        hops, (send2, recv2), group = ctx.hops, ctx.splits2, ctx.group
        fmt = None if ctx.wire is None else ctx.wire.backward
        g_A1D = exchange_in(fmt, grad_ND, send2, recv2, group, ctx.in_dtype, ctx.waiter)
        g_U1D = g_A1D.new_zeros(ctx.rows1, g_A1D.shape[-1])
        g_U1D.index_add_(0, hops.fan_A1.to(g_A1D.device), g_A1D)
        g_UD = exchange_in(fmt, g_U1D, hops.send1, hops.recv1, group, ctx.in_dtype, ctx.waiter)
        return g_UD, None, None, None, None, None, None


class HierarchicalDispatcher(ExpertParallelDispatcher):
    """ExpertParallelDispatcher whose rows cross nodes once per (token, node): same routing,
    placement and expert-side rows; `nodes` says which ep ranks share a node."""

    def __init__(self, num_experts: int, group, replica_slots: int, nodes: ExpertNodes):
        super().__init__(num_experts, group, replica_slots)
        if nodes.world != self.world:
            raise ValueError(f"nodes describe {nodes.world} ranks, the ep group has {self.world}")
        self.nodes = nodes

    def _hop1(self, sp, x_TD):
        """-> (x_UD, token_U, send1, recv1, index_A, send_a, recv_a, mine, on_node): this
        rank's unique (node, token) rows in node order, each assignment's index among the rows
        sent to its node, the splits of both, the sources this rank is the proxy of and the
        ranks of its node. Static shapes on the device; the host waits once, for the unique
        rows per node and the rows this rank receives as a proxy (one copy of both)."""
        P, r, nodes, T = self.world, self.rank, self.nodes, x_TD.shape[0]
        dev, n = x_TD.device, nodes.num_nodes
        rows_P = sp.table_PPW[r].sum(1)
        node_A_host = np.repeat(np.asarray(nodes.node_of_rank, dtype=np.int64), rows_P)
        assign_node = np.bincount(node_A_host, minlength=n)
        node_A = torch.tensor(node_A_host.tolist(), dtype=torch.long, device=dev)
        key_A = node_A * T + sp.local.token_N[:node_A.numel()]  # the sent (kept) rows
        sorted_A, order_A = torch.sort(key_A)
        first_A = torch.ones_like(sorted_A, dtype=torch.bool)
        first_A[1:] = sorted_A[1:] != sorted_A[:-1]
        uid_A = torch.cumsum(first_A, 0) - 1                    # unique row of each, sorted
        inv_A = torch.empty_like(uid_A).scatter_(0, order_A, uid_A)
        per_node = torch.zeros(n, dtype=torch.long, device=dev).scatter_add_(
            0, torch.div(sorted_A, T, rounding_mode="floor"), first_A.long())
        proxies = [nodes.proxy(r, m) for m in range(n)]
        send1_P = torch.zeros(P, dtype=torch.long, device=dev).index_add_(
            0, torch.tensor(proxies, device=dev), per_node)
        recv1_P = exchange_counts(send1_P.view(P, 1), self.group).view(P)
        both = torch.cat([per_node, recv1_P]).cpu().numpy()     # the host's second wait
        per_node_h, recv1 = both[:n], tuple(both[n:].tolist())
        start_node = torch.cumsum(per_node, 0) - per_node
        index_A = inv_A - start_node[node_A]
        send1, send_a = [0] * P, [0] * P
        for m in range(n):
            send1[proxies[m]], send_a[proxies[m]] = int(per_node_h[m]), int(assign_node[m])
        U = int(per_node_h.sum())
        token_U = torch.remainder(sorted_A[torch.argsort(~first_A, stable=True)[:U]], T)
        mine = [s for s in range(P) if nodes.proxy(s, nodes.node_of_rank[r]) == r]
        on_node = [d for d in range(P) if nodes.node_of_rank[d] == nodes.node_of_rank[r]]
        recv_a = [0] * P
        for s in mine:
            recv_a[s] = int(sp.table_PPW[s][on_node].sum())
        x_UD = gather_sorted(x_TD, DispatchMeta(token_U, None, None, 0, T, None))
        return x_UD, token_U, tuple(send1), recv1, index_A, send_a, recv_a, mine, on_node

    def dispatch(self, x_TD: torch.Tensor, routing, wire=None, waiter=None):
        """-> (x_ND, counts_L, meta): the rows of the flat dispatch, in the same order."""
        P, r, W = self.world, self.rank, self.num_local + self.replica_slots
        dev = x_TD.device
        sp = self.plan(x_TD, routing)
        x_UD, token_U, send1, recv1, index_A, send_a, recv_a, mine, on_node = self._hop1(sp, x_TD)
        # the assignments' row indices (no gradient) and gates (differentiable) to the proxies
        idx_A1 = start_exchange(index_A.to(torch.int32).view(-1, 1), recv_a, send_a, self.group,
                                async_op=False)[0].view(-1).long()
        gate_A = sp.local.gate_N[:sp.x_AD.shape[0]]  # the sent (kept) rows
        gate_A1 = all_to_all(gate_A.view(-1, 1), recv_a, send_a, self.group, None, waiter).view(-1)
        # as a proxy: assignments arrive (source, destination, slot); hop 2 sends (destination, slot, source)
        mask = np.zeros((P, P, 1), dtype=np.int64)
        mask[np.ix_(mine, on_node)] = 1
        recv_PX = (sp.table_PPW * mask).reshape(P, P * W)
        order_A1 = source_to_expert_order(torch.tensor(recv_PX.tolist(), device=dev), sum(recv_a))
        recv1_h = np.asarray(recv1, dtype=np.int64)
        start_A1 = np.repeat(np.cumsum(recv1_h) - recv1_h, recv_a)
        row_A1 = idx_A1 + torch.tensor(start_A1.tolist(), dtype=torch.long, device=dev)
        hops = Hops(send1, recv1, row_A1[order_A1], gate_A1[order_A1], token_U)
        ex = self.exchange_plan(proxy_table(sp.table_PPW, self.nodes), sp.placement, dev)
        x_ND = _TwoHops.apply(x_UD, hops, ex.send_splits, ex.recv_splits, self.group, wire, waiter)
        meta = EPDispatchMeta(sp.local, ex.send_splits, ex.recv_splits, ex.unperm_N,
                              ex.counts_L, sp.placement, hops, ex.perm_N)
        return permute_rows(x_ND, ex.perm_N, ex.unperm_N), list(ex.counts_L), meta

    def sent_gates(self, meta: EPDispatchMeta) -> torch.Tensor:
        """fp32 [A1]: the gates this rank forwards as a proxy, in hop 2's send order (gates()
        sends them beside hop 2's rows, a node-local exchange; its backward returns the
        gradients to the proxy, and hop 1's gate exchange to the routers)."""
        return meta.hops.gate_A1

    def combine(self, y_ND: torch.Tensor, meta: EPDispatchMeta, out_dtype, wire=None,
                waiter=None, weighted: bool = True) -> torch.Tensor:
        hops = meta.hops
        y_A1D = all_to_all(permute_rows(y_ND, meta.unperm_N, meta.perm_N), list(meta.send_splits),
                           list(meta.recv_splits),
                           self.group, wire, waiter)
        per_row = DispatchMeta(hops.fan_A1, hops.gate_A1, None, 0, sum(hops.recv1), None)
        z_U1D = weighted_combine(y_A1D, per_row, y_A1D.dtype, weighted)
        z_UD = all_to_all(z_U1D, list(hops.send1), list(hops.recv1), self.group, wire, waiter)
        per_token = DispatchMeta(hops.token_U, torch.ones_like(hops.token_U, dtype=torch.float32),
                                 None, 0, meta.local.num_tokens, None)
        return weighted_combine(z_UD, per_token, out_dtype)
