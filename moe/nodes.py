"""Which node each rank of the expert-parallel group sits on (pure arithmetic on global ranks).

Shapes: P ranks of the ep group, n nodes it spans, G = P / n of its ranks per node, E experts,
L = E / P experts owned per rank.

A node is a block of `gpus_per_node` consecutive global ranks (how launchers number them).
The ep group's ranks are listed in ascending global rank, so each node holds a contiguous run
of ep ranks and therefore a contiguous block of E / n experts: node k owns experts
[k E/n, (k+1) E/n). Node-aware dispatch (moe/hierarchical.py) and node-limited routing
(moe.max_nodes, moe/scoring.py) both need every node to hold the same number G of the group's
ranks; `expert_nodes` refuses a layout where it does not.

The proxy of source rank s on node m is the rank of node m with s's local index (its position
among the group's ranks of its own node): a token crosses to node m once, to that rank, which
forwards it to the experts of its node (moe/hierarchical.py).
"""
from dataclasses import dataclass

__all__ = ["ExpertNodes", "expert_nodes", "one_node"]


@dataclass(frozen=True)
class ExpertNodes:
    node_of_rank: tuple   # per ep rank: its node, 0..n-1, ascending with the rank

    @property
    def world(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return self.node_of_rank[-1] + 1

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.num_nodes

    def local_index(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def proxy(self, src: int, node: int) -> int:
        """The rank of `node` that receives src's tokens bound for that node."""
        return node * self.ranks_per_node + self.local_index(src)

    def node_of_expert(self, expert: int, num_experts: int) -> int:
        return expert // (num_experts // self.num_nodes)


def one_node(world: int) -> ExpertNodes:
    return ExpertNodes((0,) * world)


def expert_nodes(global_ranks, gpus_per_node: int) -> ExpertNodes:
    """The nodes of an ep group whose members are `global_ranks` (in group order) when nodes
    are blocks of `gpus_per_node` global ranks; ValueError naming the fields otherwise."""
    ranks = list(global_ranks)
    if not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool) or gpus_per_node < 1:
        raise ValueError(f"parallel.gpus_per_node={gpus_per_node!r} must be a positive integer "
                         f"(the ranks of one node; 0 in the config: the launcher's local world size)")
    if ranks != sorted(ranks):
        raise ValueError(f"the expert-parallel group's ranks {ranks} are not in ascending order; "
                         f"build the group from parallel/mesh.py")
    raw = [r // gpus_per_node for r in ranks]
    labels = {n: i for i, n in enumerate(dict.fromkeys(raw))}
    node_of = tuple(labels[n] for n in raw)
    per = [node_of.count(k) for k in range(len(labels))]
    if len(set(per)) > 1:
        raise ValueError(f"the expert-parallel group (global ranks {ranks}) has {per} ranks on its "
                         f"nodes of parallel.gpus_per_node={gpus_per_node}: node-aware dispatch and "
                         f"moe.max_nodes need the same number on every node; choose parallel.ep and "
                         f"gpus_per_node so that ep ranks fill nodes evenly")
    return ExpertNodes(node_of)
