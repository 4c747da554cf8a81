"""The expert all-to-all's bytes inside this rank's node and across nodes, per moe.dispatch.

Per MoE layer and micro-batch on one rank: T tokens, A = T K assignments it sends (capped by
the capacity factor), N = r A rows its experts receive (r: the imbalance), P ranks of the ep
group, G of them on this rank's node, n nodes the group spans, f = G / P the share of a
uniform spread that stays on the node (the rank itself included, as the ledger counts it),
nu the expected distinct nodes a token's experts lie on, E experts; row bytes d (forward
dispatch), c (forward combine), b (either backward) from moe/wire.py; x2 forward terms under
recomputation.

The calls and their bytes are the dispatchers' own tables (moe/ep_dispatcher.py FLAT_CALLS,
moe/hierarchical.py HIERARCHICAL_CALLS), priced with a uniform spread, which makes a rank's
proxy load its own: A1 = A, U1 = U, with U = min(T nu, A) the unique (token, node) rows
(flat: U = A, unused). Calls of reach "group" split as f inside / 1 - f across, "node" calls
stay inside; forward calls run `passes` times. So:
  flat          forward A d + N c + the [P, E] int64 count table, backward (A + N) b, all
                of it split f / 1 - f
  hierarchical  inside and across as f / 1 - f: hop 1's U rows forward (d) and back (c),
                their gradients both ways (2 U b), each assignment's int32 row index and fp32
                gate (8 A), the gates' gradients (4 A), the [P, 1] and [P, E] count tables;
                inside only: hop 2's A rows to the experts (d) and N back (c), their gradients
                (A + N) b.
The two hops run one after the other (no overlap between them): the planner adds their
times, each on its own link (step_time.py).

nu: the workload's measured nodes per token (a load profile's nodes_per_token mean, planner
--nodes-per-token), else uniform routing's n (1 - C(E - E/n, K) / C(E, K)), or under
moe.max_nodes = M < n: M (1 - C(E_M - E/n, K) / C(E_M, K)) with E_M = M E / n (the token's
K experts spread uniformly over its M kept nodes).
"""
from dataclasses import dataclass
from math import comb

from moe.ep_dispatcher import FLAT_CALLS, FLAT_GATE_CALLS
from moe.hierarchical import HIERARCHICAL_CALLS, HIERARCHICAL_GATE_CALLS

from ..plan import ep_group_of

# by dispatch_mode: moe.dispatch, "+gates" under moe.gates_in_experts (the gates' exchanges)
DISPATCH_CALLS = {"flat": FLAT_CALLS, "hierarchical": HIERARCHICAL_CALLS,
                  "flat+gates": FLAT_GATE_CALLS, "hierarchical+gates": HIERARCHICAL_GATE_CALLS}


def dispatch_mode(moe) -> str:
    """The key of the MoE config's dispatcher table in DISPATCH_CALLS."""
    mode = getattr(moe, "dispatch", "flat")
    return mode + "+gates" if getattr(moe, "gates_in_experts", False) else mode


@dataclass(frozen=True)
class EpNodes:
    ep: int      # P: ranks of the expert-parallel group
    per: int     # G: of them on this rank's node
    count: int   # n: nodes the group spans


def ep_nodes(plan, rank: int, node_size: int) -> EpNodes:
    """The node layout of `rank`'s expert-parallel group when nodes hold node_size ranks."""
    group = ep_group_of(plan, rank)
    node = rank // node_size
    return EpNodes(len(group), sum(r // node_size == node for r in group),
                   len({r // node_size for r in group}))


def nodes_per_token(w, nodes: EpNodes) -> float:
    """nu, the expected distinct nodes of a token's experts (see the module docstring)."""
    if getattr(w, "nodes_per_token", 0):
        return w.nodes_per_token
    moe, n = w.moe_cfg, nodes.count
    if n <= 1:
        return 1.0
    E, K = moe.num_experts, moe.top_k
    M = min(getattr(moe, "max_nodes", 0) or n, n)
    per_node = E // n
    if per_node == 0:  # more nodes than experts (a structure the search bounds before its
        return float(min(K, M))  # validation refuses it): each expert on its own node
    reach = M * per_node
    if reach < K:  # M nodes hold fewer than K experts (a structure validation refuses, met by
        return float(min(n, -(-K // per_node)))  # the search's bound): the fewest nodes with K
    return M * (1 - comb(reach - per_node, K) / comb(reach, K))


def expert_a2a_bytes(mode: str, tokens: float, own: float, r: float, nu: float,
                     nodes: EpNodes, E: int, rows: tuple, passes: int) -> tuple:
    """(bytes inside the node, bytes across nodes) of one MoE layer's all-to-alls for one
    micro-batch on this rank: forward `passes` times, backward once."""
    d, c, b = rows
    U = min(tokens * nu, own) if mode.startswith("hierarchical") else own
    sizes = dict(P=nodes.ep, E=E, A=own, A1=own, U=U, U1=U, N=r * own, d=d, c=c, b=b)
    spread = inside = 0.0
    for call in DISPATCH_CALLS[mode]:
        nbytes = call.nbytes(sizes) * (passes if call.phase == "forward" else 1)
        if call.reach == "group":
            spread += nbytes
        else:
            inside += nbytes
    f = nodes.per / nodes.ep
    return spread * f + inside, spread * (1 - f)
