"""What one rank holds under a layout, read from the real parallelization of a meta model.

The planner does not re-derive the layout's sharding: it runs parallel.apply.parallelize on
a model built on the meta device (no memory, no weights) inside a "fake" process group
(torch's testing backend: every collective returns at once, nothing is sent), for the rank
it asks about, and reads the local tensors it ends up with: parameters (tp/ep/pp/FSDP2
pieces), ZeRO-1/2 slices, FSDP2 units and the reduction buckets' groups. So model-state
bytes and the gradient-sync payloads are exact for every layout parallel/ can build.

The fake group needs a process without its own process group (the planner CLI, a test,
a notebook before init_process_group).
"""
import contextlib
import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from models.blocks import block_stacks

from ..apply import parallelize
from ..dtensors import local
from ..mesh import build_meshes
from ..plan import ParallelPlan

__all__ = ["RankState", "Tensors", "read_rank_state", "group_dims", "fake_world", "with_cp"]


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """A process group of `world` ranks in which this process is `rank`; nothing is sent."""
    if dist.is_initialized():
        raise RuntimeError("the layout planner runs parallelize() in a fake process group and "
                           "needs a process without one; call it before init_process_group")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


DIMS = ("pp", "dp", "tp", "edp", "ep", "etp", "pool")
GRID_DIMS = ("tpd", "tpr", "tpc")


def group_dims(meshes) -> dict:
    """{dim: (frozenset of the dims served by the same process group, group size)}: a group
    serving several dims (DeviceMesh hands out the default group for a dim spanning the
    whole world) counts as all of them, exactly as parallel/ledger.py's CommLedger sees it."""
    dims = DIMS + (GRID_DIMS if meshes.grid is not None else ()) + \
        (("cp",) if meshes.cp_group is not None else ())
    names = {d: meshes.group(d).group_name for d in dims}
    return {d: (frozenset(e for e in dims if names[e] == names[d]), meshes.size(d)) for d in dims}


@dataclass
class Tensors:
    """Bytes of a set of tensors, and how many there are (per-tensor optimizer scalars)."""
    bytes: int = 0
    count: int = 0
    shapes: list = field(default_factory=list)

    def add(self, t: torch.Tensor) -> None:
        self.bytes += t.numel() * t.element_size()
        self.count += 1
        self.shapes.append(tuple(t.shape))


@dataclass
class RankState:
    plan: ParallelPlan
    rank: int
    params: Tensors                 # the local parameter tensors (tied weight once)
    buckets: list                   # [(kind, dims, group size, local grad bytes, slice bytes, padded bytes)]
                                    # (zero 0, 1 and 2 reduce the same buckets)
    fsdp_units: list                # [(dims, group size, shard bytes, is_root, hpZ group size or 0)]
    slices: Tensors                 # ZeRO-1/2 flat slices (the same for both stages; empty otherwise)
    block_ids: list                 # transformer blocks on this rank
    first_stage: bool
    last_stage: bool
    tied_pair: bool                 # a weight shared with the other end of the pipeline
    tied_bytes: int
    largest_param_bytes: int
    replicated_tp_bytes: int        # tp-replicated DTensor params (norms): grads all-reduced over tp
    grid_grad_sums: dict            # tp_mode 2d/2.5d: {grid dim: local grad bytes all-reduced over
                                    # it} (params replicated there: their Partial gradients)
    groups: dict                    # group_dims(meshes)
    muon: tuple = (None, None)      # MuonFacts without and with ZeRO-1/2 slices (muon_facts)
    matmul_bytes: tuple = (0, 0)    # (the blocks', the rest's) weights GEMMs read (Linear
                                    # weights, expert banks), as gathered for the forward


@dataclass(frozen=True)
class MuonFacts:
    """train.optimizer=muon on this rank (optim/muon.py split, parallel/muon.py exchange):
    stepped_bytes / stepped_count: the tensors Muon steps (momentum: one buffer each; ZeRO-1/2's
    slices of the Muon matrices, else their local pieces); exchange: [(mesh dim, group size,
    bytes)] per matrix held in pieces: what this rank hands to the two all_to_alls for it (its
    padded piece to the owner unless it is a copy; as the owner, every rank's piece back); gathered:
    the owner's transient bytes at the step (its receive buffer, each owned matrix whole and
    two Newton-Schulz temporaries of it)."""
    stepped_bytes: int = 0
    stepped_count: int = 0
    exchange: tuple = ()
    gathered: int = 0


def read_rank_state(build_model, plan: ParallelPlan, rank: int) -> RankState:
    """Parallelize a fresh meta model (`build_model()`) for `rank` of a validated plan.
    ZeRO 0, 1 and 2 hold the same tensors apart from the slices, so a plan with zero 1
    answers for all three (the caller picks what its stage uses)."""
    if plan.world == 1 and plan.param_dtype == "fp32":  # bf16 parameters: train.py's group of one
        return _read(parallelize(build_model(), plan, None, loss_fn=_no_loss), plan, rank)
    with fake_world(rank, plan.world):
        par = parallelize(build_model(), plan, build_meshes(plan, "cpu"), loss_fn=_no_loss)
        return _read(par, plan, rank)


def with_cp(state: RankState, cp: int) -> RankState:
    """The state of the same rank when its stage's dp x cp replicas split into `cp` sequence
    parts instead: every tensor, bucket and unit is the same (they see the replicas, dp x cp,
    as one group: mesh.py's dense "dp" dim), only the cp group differs, a process group of
    its own (tests/unit/test_planner.py reads both and compares)."""
    if state.groups.get("cp", (None, 1))[1] == cp or not state.groups:
        return state
    groups = {d: g for d, g in state.groups.items() if d != "cp"}
    if cp > 1:
        groups["cp"] = (frozenset({"cp"}), cp)
    return replace(state, groups=groups)


def _no_loss(logits, targets):
    return logits.sum()


def _read(par, plan, rank) -> RankState:
    model, params = par.model, Tensors()
    for p in model.parameters():
        params.add(local(p))
    groups = group_dims(par.meshes) if par.meshes is not None else {}
    slices = Tensors()
    if par.zero is not None:
        for s in par.zero.shard_of.values():
            slices.add(s)
    stacks = block_stacks(model)  # pipeline stages split the GPT's one stack
    names = [n for n, _ in stacks[0].named_children()] if len(stacks) == 1 else []
    first = getattr(model, "tok_emb", 1) is not None
    last = getattr(model, "lm_head", 1) is not None
    tied = par.tied is not None and par.tied.group is not None
    return RankState(plan, rank, params, _buckets(par, groups),
                     _fsdp_units(model, groups) if plan.zero == 3 and plan.world > 1 else [],
                     slices, [int(n) for n in names], first, last, tied,
                     _nbytes(local(par.tied.param)) if tied else 0,
                     max((_nbytes(local(p)) for p in model.parameters()), default=0),
                     _replicated_tp(model), _grid_grad_sums(model), groups,
                     _muon_facts(par, groups), _matmul_bytes(model, plan))


def _matmul_bytes(model, plan) -> tuple:
    """(blocks, rest): bytes of the weights GEMMs read in the forward, in the transformer
    blocks and outside them (the head, tied or not): every Linear's weight and the expert
    banks, at their local size (ZeRO-3: x the FSDP group the dense or expert side is sharded
    over, gathered for the forward)."""
    from torch import nn

    from ..kinds import is_expert_param
    seen, total = set(), [0, 0]
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            gemm = (isinstance(mod, nn.Linear) and pname == "weight") or is_expert_param(name)
            if gemm and id(p) not in seen:
                seen.add(id(p))
                gathered = 1
                if plan.zero == 3:
                    gathered = plan.edp if is_expert_param(name) else plan.replicas
                total["blocks" not in name.split(".")] += _nbytes(local(p)) * gathered
    return tuple(total)


def muon_facts(state, plan):
    """The MuonFacts of `plan`'s ZeRO stage (a read with slices answers zero 0, 1 and 2)."""
    return state.muon[plan.zero in (1, 2)]


def _muon_facts(par, groups) -> tuple:
    """(without slices, with ZeRO-1/2 slices): what Muon would step and exchange on this rank;
    None where parallel/muon.py cannot hold the layout's pieces (trainer/config.py refuses)."""
    whole = _muon_variant(par, groups, sliced=False)
    return whole, (_muon_variant(par, groups, sliced=True) if par.zero is not None else whole)


def _muon_variant(par, groups, sliced: bool):
    from optim.muon import split_params
    from ..muon import CHECK_BYTES, layout_groups, owners, pieces_of
    muon_params, _ = split_params(par.model)
    names = {id(p): n for n, p in par.model.named_parameters()}
    etp = par.meshes.group("etp") if par.plan.etp > 1 and par.meshes is not None else None
    wide = layout_groups(par.meshes) if par.meshes is not None else ()
    slice_of = par.zero.shard_of if sliced else {}
    slice_group = {id(s): sl.group for sl in (par.zero.slices if sliced else ()) for s in sl.shards}
    dim_of = {par.meshes.group(d).group_name: d for d in reversed(list(groups))} \
        if par.meshes is not None else {}
    stepped, by_group = Tensors(), {}
    try:
        for p in muon_params:
            t = slice_of.get(id(p), p)
            stepped.add(local(t))
            d = pieces_of(p, names.get(id(p), ""), slice_group.get(id(t)), etp, wide)
            if d is not None and d.size > 1:
                by_group.setdefault(d.group.group_name, []).append((d, local(t).element_size()))
    except ValueError:  # a sharding parallel/muon.py does not take (config refuses the layout)
        return None
    except RuntimeError:  # a sub-mesh group the planner's fake world cannot resolve (zero 3 with
        return None       # pipeline and ep): counted as AdamW's state, an overestimate
    exchange, gathered = [], 0
    for name, items in by_group.items():
        P, me = items[0][0].size, dist.get_rank(items[0][0].group)
        own = owners([d.shape for d, _ in items], P)
        exchange.append((dim_of.get(name), P, CHECK_BYTES))  # check_same_matrices, each step
        for i, (d, size) in enumerate(items):  # a source sends its piece, the owner P pieces back
            pad = max(d.numels()) * size
            exchange.append((dim_of.get(name), P, pad * (d.sources()[me] + (P if own[i] == me else 0))))
            if own[i] == me:
                gathered += P * pad + 3 * math.prod(d.shape) * size
    return MuonFacts(stepped.bytes, stepped.count, tuple(exchange), gathered)


def _replicated_tp(model) -> int:
    from torch.distributed.tensor import DTensor, Replicate
    total = 0
    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) and \
                all(isinstance(pl, Replicate) for pl in p.placements):
            total += _nbytes(local(p))
    return total


def _grid_grad_sums(model) -> dict:
    """parallel/tensor/grid.py's gradients are Partial over the grid dims a parameter is
    replicated on; the gradient sync all-reduces them there (one per dim of size > 1)."""
    from torch.distributed.tensor import DTensor, Replicate
    out = {}
    for p in model.parameters():
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        if not set(GRID_DIMS) <= set(names):
            continue
        for name, pl, n in zip(names, p.placements, p.device_mesh.shape):
            if isinstance(pl, Replicate) and n > 1:
                out[name] = out.get(name, 0) + _nbytes(local(p))
    return out


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


_BUCKET_DIM = {"dense": "dp", "pool": "pool", "expert": "edp"}


def _buckets(par, groups) -> list:
    """The gradient-reduction buckets of zero 0/1/2 (grad_sync.reduction_buckets' grouping):
    [(kind, dims, group size, full grad bytes, slice bytes, padded full bytes)]; the slice
    columns are ZeRO-1/2's (zero.ZeroState is built from the same buckets, in order)."""
    if par.grad_sync is None:
        return []
    slices = par.zero.slices if par.zero is not None else [None] * len(par.grad_sync.buckets)
    out = []
    for (kind, _group, _div, params), sl in zip(par.grad_sync.buckets, slices):
        dims, size = groups[_BUCKET_DIM[kind]]
        full = sum(_nbytes(local(p)) for p in params)
        elem = local(params[0]).element_size()
        mine = sum(sl.L) * elem if sl is not None else 0
        out.append((kind, dims, size, full, mine, mine * size))
    return out


def _fsdp_units(model, groups) -> list:
    """[(dims, size, shard bytes, is_root, hpz)] of every fully_shard module, own params only;
    hpz: the size of the secondary (post-forward) shard group FSDP2 set up for ZeRO++ hpZ,
    0 when the unit frees its parameters after forward (read from FSDP2's own state)."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    owner = {}
    for m in units:  # modules() is pre-order: a deeper unit overwrites its ancestor
        for p in m.parameters():
            owner[id(p)] = m
    out = []
    for m in units:
        own = [p for p in m.parameters() if owner[id(p)] is m]
        if not own:
            continue
        mesh = own[0].device_mesh
        dim = mesh.mesh_dim_names[0] if mesh.mesh_dim_names else "dp"
        dims, size = groups.get(dim, (frozenset({dim}), mesh.size()))
        out.append((dims, size, sum(_nbytes(local(p)) for p in own), m is model, _hpz_size(m)))
    return out


def _hpz_size(module) -> int:
    groups = module._get_fsdp_state()._fsdp_param_groups  # FSDP2 internals: no public reader
    if not groups:
        return 0
    after, shard = groups[0].post_forward_mesh_info, groups[0].mesh_info.shard_mesh_size
    # None: kept whole (the root); the unit's own mesh: freed; a smaller mesh: hpZ
    return after.shard_mesh_size if after is not None and after.shard_mesh_size < shard else 0
