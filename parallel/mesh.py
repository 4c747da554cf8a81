"""Device meshes built from a validated ParallelPlan (see plan.py for the rank layout).

P ranks = pp * dp * cp * tp. Views of the same ranks, each a DeviceMesh with named dims:
  dense  ("pp", "dp", "tp"):         attention/embeddings/dense FFN; dp averages, tp splits.
                                     Its dp dim holds the dp x cp replicas of the dense
                                     weights (context-parallel ranks are copies too).
  cp                                 only under cp > 1: the replicas split into dp row
                                     streams x cp sequence parts ("rows", "cp"); the cp
                                     group is a process group of its own (DeviceMesh shares
                                     a group among dims with the same ranks, and the ledger
                                     must tell the ring's traffic from dp/ep traffic).
  expert ("pp", "edp", "ep", "etp"): MoE experts; ep splits experts, etp splits each
                                     expert's d_ff, edp holds copies.
  pool   ("pp", "pool"):             the dp*cp*tp ranks of one stage that see distinct tokens in
                                     MoE layers; router (and shared-expert) grads reduce over it.
  grid   ("pp", "dp", "tpd", "tpr", "tpc")  only under tp_mode 2d/2.5d: the tp ranks as
                                     tp_depth stacked q x q grids (parallel/tensor/grid.py).
Rank r sits at dense[r // (dp*cp*tp), (r // tp) % (dp*cp), r % tp] (its row stream is that
replica index // cp, its sequence part the index % cp); the pool index is r % (dp*cp*tp) and
the expert coordinates are (pool // (ep*etp), (pool // etp) % ep, pool % etp), the grid
coordinates of tp rank t are (t // (q*q), (t // q) % q, t % q), so with
etp == 1 and ep == tp the ep group is the tp group, and with etp == tp the etp group is.
Every mesh creation is a collective: all ranks must call build_meshes with the same plan.
`rank_groups(plan)` is the same layout as pure arithmetic (no process group needed).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .pipeline.schedules import V_SCHEDULES
from .plan import ParallelPlan


def default_device_type() -> str:
    """'cuda' when this process has a GPU, else 'cpu' (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Meshes:
    plan: ParallelPlan
    dense: DeviceMesh
    expert: DeviceMesh
    pool: DeviceMesh
    grid: DeviceMesh | None = None
    cp_group: object = None     # this rank's context-parallel group (cp > 1)

    def group(self, name: str):
        """Process group of this rank along one named dim: pp, dp, tp, edp, ep, etp, pool, and
        under a 2d/2.5d tp_mode tpd, tpr, tpc; under cp > 1 cp."""
        if name == "cp" and self.cp_group is not None:
            return self.cp_group
        for mesh in (self.dense, self.expert, self.pool, self.grid):
            if mesh is not None and name in mesh.mesh_dim_names:
                return mesh.get_group(name)
        raise KeyError(f"no mesh dim named {name!r}; use pp, dp, tp, edp, ep, etp or pool "
                       f"(tpd, tpr, tpc under parallel.tp_mode 2d/2.5d; cp under parallel.cp > 1)")

    def size(self, name: str) -> int:
        return dist.get_world_size(self.group(name))

    def rank(self, name: str) -> int:
        return dist.get_rank(self.group(name))

    @property
    def pp_rank(self) -> int:
        return dist.get_rank() // self.plan.pool


def build_meshes(plan: ParallelPlan, device_type: str | None = None) -> Meshes:
    """Create the dense, expert and pool meshes for a plan already validated for the world."""
    if not dist.is_initialized():
        raise RuntimeError("build_meshes needs torch.distributed initialised (init_process_group)")
    world = dist.get_world_size()
    if plan.dp < 1 or plan.world != world:
        raise ValueError(f"plan is for {plan.world if plan.dp > 0 else '?'} ranks but the world has "
                         f"{world}; call plan.validate({world}) first and pass its result")
    device_type = device_type or default_device_type()
    ranks = torch.arange(world)
    views = _views(plan, ranks)
    meshes = {key: DeviceMesh(device_type, grid, mesh_dim_names=names)
              for key, (names, grid) in views.items() if key != "context"}
    return Meshes(plan, meshes["dense"], meshes["expert"], meshes["pool"], meshes.get("grid"),
                  _cp_group(plan))


def _cp_group(plan: ParallelPlan):
    """Collective (every rank creates every cp group, in the same order): this rank's."""
    return _mine(rank_groups(plan)["cp"]) if plan.cp > 1 else None


def expert_data_group(plan: ParallelPlan):
    """Collective: this rank's group over the edp x etp ranks of its stage and ep index (the
    ranks holding ZeRO's slices of one expert's tensor-parallel blocks: parallel/muon.py)."""
    grid = _views(plan, torch.arange(plan.world))["expert"][1]
    return _mine([grid[p, :, e, :].flatten().tolist() for p in range(plan.pp) for e in range(plan.ep)])


def _mine(rank_lists: list):
    """Collective (every rank creates every group, in the same order): this rank's group."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _views(plan: ParallelPlan, ranks) -> dict:
    """{mesh: (dim names, rank tensor)}: the one rank layout build_meshes and rank_groups share."""
    views = {"dense": (("pp", "dp", "tp"), ranks.reshape(plan.pp, plan.replicas, plan.tp)),
             "expert": (("pp", "edp", "ep", "etp"), ranks.reshape(plan.pp, plan.edp, plan.ep, plan.etp)),
             "pool": (("pp", "pool"), ranks.reshape(plan.pp, plan.pool))}
    if plan.tp_mode != "1d":
        views["grid"] = (GRID_DIMS, ranks.reshape(*_grid_shape(plan)))
    if plan.cp > 1:
        views["context"] = (CONTEXT_DIMS, ranks.reshape(plan.pp, plan.dp, plan.cp, plan.tp))
    return views


GRID_DIMS = ("pp", "dp", "tpd", "tpr", "tpc")
CONTEXT_DIMS = ("pp", "rows", "cp", "tp")


def _grid_shape(plan: ParallelPlan) -> tuple:
    q = plan.tp_grid
    return plan.pp, plan.dp, plan.tp_depth, q, q


def rank_groups(plan: ParallelPlan) -> dict:
    """{dim: [rank list of every group along it]} for pp, dp, tp, edp, ep, etp and pool (and
    tpd, tpr, tpc under a 2d/2.5d tp_mode, rows and cp under cp > 1), computed
    without communication: exactly the groups build_meshes creates for this plan."""
    out = {}
    for names, grid in _views(plan, torch.arange(plan.world)).values():
        for d, name in enumerate(names):
            if name in out:
                continue
            moved = grid.movedim(d, -1)
            out[name] = moved.reshape(-1, moved.shape[-1]).tolist()
    return out


def stage_pair_group(meshes: Meshes):
    """Collective (every rank calls it): the group of this rank's first- and last-stage peers
    (same dp and tp coordinates), for a weight both ends of the pipeline hold; None when
    pp == 1, under a V-shape schedule (zbv, dualpipev: pipeline rank 0 holds both ends) or
    when this rank is in neither end stage."""
    plan, grid = meshes.plan, meshes.dense.mesh
    if plan.pp == 1 or plan.pp_schedule in V_SCHEDULES:  # V: both ends on pipeline rank 0
        return None
    mine = None
    for d in range(plan.replicas):
        for t in range(plan.tp):
            pair = [int(grid[0, d, t]), int(grid[-1, d, t])]
            group = dist.new_group(pair)  # new_group is collective: all pairs, same order
            if dist.get_rank() in pair:
                mine = group
    return mine
