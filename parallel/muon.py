"""Muon's whole-matrix orthogonalisation when a layout holds pieces of the matrices.

Shapes: P ranks of a group; n_i the numel of matrix i's largest piece (every piece is padded to
it on the wire); E experts, R rows, C columns.

Muon's momentum and its weight update are elementwise, so they run on whatever piece a rank
holds; only the Newton-Schulz iterations need the whole matrix (an expert bank [E, R, C]: E
whole matrices). For each process group whose ranks hold the pieces of the same matrices:
  1. owners: each matrix gets one owner rank of the group, largest matrices first, each to the
     rank with the least Newton-Schulz work so far (R C min(R, C) per matrix), so the work
     spreads evenly (round-robin when the matrices are alike);
  2. one all_to_all_single sends every rank's pieces to their matrices' owners;
  3. each owner assembles its matrices and orthogonalises them (banks as one batch);
  4. one all_to_all_single returns each rank its piece of every result.
Two collectives per group and step whatever the number of matrices, each moving the rank's own
pieces once (a rank sends sum_i n_i and receives as much; an all-gather of every matrix
would move P times that). Booked in the ledger as `muon_orthogonalise`.

The pieces (Pieces.axes: the group's ranks as a grid, each axis cutting one way):
  FLAT  ZeRO-1/2: the block flattened, zero-padded to P*L and cut in P rows of L
        (data_parallel/zero.py's slices)
  dim   torch.chunk's pieces along a tensor dim (the last ones shorter or empty): a DTensor's
        Shard(dim) mesh dims (FSDP2 (ZeRO-3) and 1-D tensor parallelism; the 2-D grid's rows
        over tpr and columns over tpc), and expert tensor parallelism's d_ff blocks of an
        expert bank over the etp group (plain tensors, equal blocks: moe/expert_tp.py)
  COPY  a DTensor's Replicate mesh dims (the 2.5-D grid's stacked depth): the ranks hold the
        same piece; only the first sends it, every one gets its piece of the result back
  and compositions: ZeRO-1/2's flat slices of a tensor-parallel block (FLAT outer, over the
  stage's pool group: dp x tp ranks), the grid's (COPY, dim, dim) over the tp group.
A DTensor with Replicate only holds the whole matrix: orthogonalised where it is (every replica
computes the same). Matrices no group splits (one rank's expert bank under plain expert
parallelism) stay on their rank.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

KIND = "muon_orthogonalise"
FLAT, COPY = "flat", "copy"   # Pieces axes that cut no tensor dim


@dataclass(frozen=True)
class Pieces:
    """How a group's ranks hold pieces of one matrix (or bank) of `shape`.

    axes: the group's ranks as a row-major grid (group rank = its index), one (n, cut) per
    axis, outer first; cut is a tensor dim (torch.chunk's n pieces along it), FLAT (the block
    flattened, zero-padded to n*L and cut in n rows of L: ZeRO-1/2's slices) or COPY (the n
    ranks hold the same piece; index 0 sends it). order: the axes in the order the layout cut
    the matrix (default: as listed), each cutting the block the earlier ones left (so two axes
    may cut the same dim: FSDP2's shards of an expert-tensor-parallel block); a FLAT axis cuts
    last."""
    group: object
    shape: torch.Size
    axes: tuple
    order: tuple = ()

    @property
    def size(self) -> int:
        return math.prod(n for n, _ in self.axes)

    def _index(self, r: int) -> list:
        idx = []
        for n, _ in reversed(self.axes):
            idx.append(r % n)
            r //= n
        return idx[::-1]

    def _cuts(self) -> list:
        """The dim-cutting axes in the order they cut."""
        return [a for a in (self.order or range(len(self.axes))) if isinstance(self.axes[a][1], int)]

    def _flat_axis(self):
        return next((a for a, (_, cut) in enumerate(self.axes) if cut == FLAT), None)

    def _block_shapes(self, idx: list) -> list:
        """The block's shape after each cut of _cuts() (torch.chunk's lengths: the last pieces
        shorter or 0), the matrix's shape first."""
        shapes = [list(self.shape)]
        for a in self._cuts():
            n, dim = self.axes[a]
            shape, size = list(shapes[-1]), shapes[-1][dim]
            chunk = -(-size // n)
            shape[dim] = max(0, min(chunk, size - idx[a] * chunk))
            shapes.append(shape)
        return shapes

    def numels(self) -> list:
        """Each rank's piece numel."""
        f = self._flat_axis()
        out = []
        for r in range(self.size):
            block = math.prod(self._block_shapes(self._index(r))[-1])
            out.append(block if f is None else -(-block // self.axes[f][0]))
        return out

    def sources(self) -> list:
        """Whether each rank's piece is sent to the owner (the first of each set of copies)."""
        copies = [a for a, (_, cut) in enumerate(self.axes) if cut == COPY]
        return [all(self._index(r)[a] == 0 for a in copies) for r in range(self.size)]

    def assemble(self, flat_pieces: list) -> torch.Tensor:
        """The whole matrix from the sources' flat pieces (None for the other ranks), each
        trimmed of its padding."""
        f, cuts = self._flat_axis(), self._cuts()
        parts = {}
        for r, piece in enumerate(flat_pieces):
            if piece is not None:
                idx = self._index(r)
                parts.setdefault(tuple(idx[a] for a in cuts), []).append((idx[f] if f is not None else 0, r))
        blocks = {}
        for key, held in parts.items():
            idx = [0] * len(self.axes)
            for a, i in zip(cuts, key):
                idx[a] = i
            shape = self._block_shapes(idx)[-1]
            numel = math.prod(shape)
            L = numel if f is None else -(-numel // self.axes[f][0])  # one piece, less its padding
            flat = torch.cat([flat_pieces[r].reshape(-1)[:L] for _, r in sorted(held)])
            blocks[key] = flat[:numel].view(shape)

        def join(prefix: tuple):  # the first cut outermost: each block is its sub-blocks joined
            if len(prefix) == len(cuts):
                return blocks[prefix]
            n, dim = self.axes[cuts[len(prefix)]]
            return torch.cat([join(prefix + (i,)) for i in range(n)], dim)
        return join(())

    def cut(self, whole: torch.Tensor) -> list:
        """Every rank's flat piece of `whole`."""
        f, out = self._flat_axis(), []
        for r in range(self.size):
            idx = self._index(r)
            block = whole
            for a, shape in zip(self._cuts(), self._block_shapes(idx)[1:]):
                n, dim = self.axes[a]
                chunk = -(-block.shape[dim] // n)
                block = block.narrow(dim, min(idx[a] * chunk, block.shape[dim]), shape[dim])
            flat = block.reshape(-1)
            if f is not None:
                n = self.axes[f][0]
                L = -(-flat.numel() // n)
                flat = torch.cat([flat, flat.new_zeros(n * L - flat.numel())])[idx[f] * L:(idx[f] + 1) * L]
            out.append(flat)
        return out


def ns_cost(shape) -> int:
    """Newton-Schulz work of one matrix or bank: E R C min(R, C)."""
    *lead, R, C = shape
    return math.prod(lead) * R * C * min(R, C)


def owners(shapes: list, P: int) -> list:
    """Owner rank (in the group) of each matrix: largest first, to the least-loaded rank;
    the same answer on every rank (ties to the lowest rank)."""
    load, out = [0] * P, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        r = min(range(P), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += ns_cost(shapes[i])
    return out


def exchange(pieces: list, updates: list, ns, assign=owners) -> list:
    """Collective over pieces[0].group: every rank's orthogonalised pieces of the matrices
    (pieces[i] describes matrix i; updates[i] this rank's piece of its update); assign(shapes,
    P) chooses the owners (bench/muon.py compares a single owner). A rank sends its piece of
    matrix i to the owner only where it is a source (copies send nothing) and gets its piece
    of every result back."""
    group = pieces[0].group
    P, me = dist.get_world_size(group), dist.get_rank(group)
    if P == 1:  # a group of one (e.g. expert banks with no data-parallel copies): no exchange
        return [d.cut(ns(d.assemble([u.reshape(-1)])).to(u.dtype))[0] for d, u in zip(pieces, updates)]
    own = assign([d.shape for d in pieces], P)
    pad = [max(d.numels()) for d in pieces]
    src = [d.sources() for d in pieces]
    n = range(len(pieces))
    mine = [i for i in n if own[i] == me]
    dtype, device = updates[0].dtype, updates[0].device

    def padded(t, k):
        flat = t.reshape(-1).to(dtype)
        return torch.cat([flat, flat.new_zeros(k - flat.numel())]) if flat.numel() < k else flat

    sent = [i for o in range(P) for i in n if own[i] == o and src[i][me]]
    to_owner = [sum(pad[i] for i in n if own[i] == o and src[i][me]) for o in range(P)]
    send = torch.cat([padded(updates[i], pad[i]) for i in sent]
                     or [torch.zeros(0, dtype=dtype, device=device)])
    from_each = [sum(pad[i] for i in mine if src[i][r]) for r in range(P)]
    recv = send.new_empty(sum(from_each))
    dist.all_to_all_single(recv, send, from_each, to_owner, group=group)

    back = [[] for _ in range(P)]  # per destination rank, in `mine` order
    rows = recv.split(from_each)
    for i in mine:
        flat = []
        for r in range(P):
            offset = sum(pad[j] for j in mine[:mine.index(i)] if src[j][r])
            flat.append(rows[r][offset:offset + pad[i]] if src[i][r] else None)
        for r, piece in enumerate(pieces[i].cut(ns(pieces[i].assemble(flat)).to(dtype))):
            back[r].append(padded(piece, pad[i]))
    send_back = torch.cat([t for r in range(P) for t in back[r]] or [send.new_zeros(0)])
    from_owner = [sum(pad[i] for i in n if own[i] == o) for o in range(P)]
    recv_back = send.new_empty(sum(from_owner))
    dist.all_to_all_single(recv_back, send_back, from_owner, [sum(pad[i] for i in mine)] * P, group=group)

    out, cursor = [None] * len(pieces), {o: 0 for o in range(P)}
    starts = [sum(from_owner[:o]) for o in range(P)]
    for i in n:
        o = own[i]
        begin = starts[o] + cursor[o]
        cursor[o] += pad[i]
        out[i] = recv_back[begin:begin + pieces[i].numels()[me]]
    return out


CHECK_BYTES = 32  # check_same_matrices' all-reduce: 4 int64 per group and step


def collective_device(group) -> torch.device:
    """Where a tensor for a collective on `group` must live: NCCL takes the current CUDA
    device's tensors only, gloo the CPU's."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_matrices(shapes: list, group) -> None:
    """Collective (one small all-reduce): the ranks of an exchange group must step the same
    matrices in the same order -- the all_to_alls are sized from each rank's own list, and
    lists that differ would hang or swap garbage. ValueError (the same on every rank)
    naming both counts when they do not. The check's tensor lives where the group's backend
    wants it, also on a rank with no matrix (the mismatch it reports)."""
    fingerprint = sum((i + 1) * (math.prod(s) % 1000003 + 7 * len(s)) for i, s in enumerate(shapes))
    mine = torch.tensor([len(shapes), -len(shapes), fingerprint, -fingerprint], dtype=torch.int64,
                        device=collective_device(group))
    seen = mine.clone()
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if torch.equal(seen[[0, 2]], -seen[[1, 3]]):
        return
    raise ValueError(f"train.optimizer=muon: the ranks of one exchange group step different "
                     f"matrices (between {int(-seen[1])} and {int(seen[0])} with gradients, or "
                     f"other shapes); every matrix Muon steps needs a gradient on every rank of "
                     f"its group (a parameter unused on some rank: give it a zero gradient)")


class PieceOwners:
    """MuonAdamW's orthogonaliser for a layout that holds pieces of matrices.

    pieces: {id(optimizer param): Pieces} for the parameters held in pieces; groups: the
    process groups in the order every rank exchanges them (a fixed kind order: dense, pool,
    expert, so no two ranks wait on each other's groups in opposite orders); comm_label(kind):
    the ledger's labelling context (or None)."""

    def __init__(self, pieces: dict, groups: list, comm_label=None, assign=owners, device=None):
        self.pieces, self.groups, self.comm_label, self.assign = pieces, groups, comm_label, assign
        self.device = device  # where the exchange and Newton-Schulz run (None: the updates' own)

    def shape(self, p) -> torch.Size:
        d = self.pieces.get(id(p))
        return d.shape if d is not None else p.shape

    def __call__(self, params, updates, ns) -> list:
        out = [None] * len(params)
        for k, (p, u) in enumerate(zip(params, updates)):
            if id(p) not in self.pieces:  # whole here (a Replicate DTensor holds it whole too)
                out[k] = _on_local(u, ns)
        label = self.comm_label(KIND) if self.comm_label is not None else contextlib.nullcontext()
        with label:
            for group in self.groups:
                ks = [k for k, p in enumerate(params) if id(p) in self.pieces and self.pieces[id(p)].group is group]
                if dist.get_world_size(group) > 1:  # before any exchange sized from ks
                    check_same_matrices([self.pieces[id(params[k])].shape for k in ks], group)
                if not ks:
                    continue
                locals_ = [_local(updates[k]) for k in ks]  # host ones (offload) to the device
                sent = [t.to(self.device) if self.device is not None else t for t in locals_]
                done = exchange([self.pieces[id(params[k])] for k in ks], sent, ns, self.assign)
                for k, loc, flat in zip(ks, locals_, done):
                    out[k] = _like(updates[k], flat.view(loc.shape).to(loc.device))
        return out


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _on_local(u, ns):
    if isinstance(u, DTensor):
        return DTensor.from_local(ns(u.to_local()).to(u.dtype), u.device_mesh, u.placements,
                                  run_check=False, shape=u.shape, stride=u.stride())
    return ns(u)


def _like(u, local_piece):
    if isinstance(u, DTensor):
        return DTensor.from_local(local_piece, u.device_mesh, u.placements, run_check=False,
                                  shape=u.shape, stride=u.stride())
    return local_piece


def pieces_of(model_p, name: str, slice_group=None, etp_group=None, wide_groups=()) -> "Pieces | None":
    """How the layout holds Muon matrix `model_p` (`name` in the model); None when it is whole on
    this rank. The cuts, in the order the layout makes them: expert tensor parallelism's d_ff
    blocks over etp_group, a DTensor's mesh dims (tensor parallelism's blocks and the grids'
    copies, or FSDP2's shards), ZeRO-1/2's flat slices over slice_group. A matrix cut over
    several groups' ranks is exchanged over the one of wide_groups (layout_groups) spanning
    exactly those ranks; ValueError when none does, or for shardings the exchange does not
    handle."""
    from moe.expert_tp import FFN_DIMS
    from .kinds import is_expert_param
    me, shape, cuts = dist.get_rank(), list(model_p.shape), []   # cuts: (n, cut, rank deltas)
    pname = name.rpartition(".")[2]
    if etp_group is not None and is_expert_param(name) and pname in FFN_DIMS:
        n = dist.get_world_size(etp_group)
        shape[FFN_DIMS[pname]] *= n
        cuts.append((n, FFN_DIMS[pname], [r - me for r in dist.get_process_group_ranks(etp_group)]))
    cuts += _dtensor_cuts(model_p, name, me)
    if slice_group is not None:
        sliced = dist.get_process_group_ranks(slice_group)
        cuts.append((len(sliced), FLAT, [r - me for r in sliced]))
    cuts = [c for c in cuts if c[0] > 1 or c[1] == FLAT]  # a slice of one is still flat
    if not cuts or all(cut == COPY for _, cut, _ in cuts):
        return None  # whole here, in its shape
    stride = [d[1] - d[0] if len(d) > 1 else 0 for _, _, d in cuts]
    ranked = sorted(range(len(cuts)), key=lambda c: -stride[c])  # rank-major: largest stride first
    ranks = [me]
    for c in ranked:
        ranks = [r + delta for r in ranks for delta in cuts[c][2]]
    groups = [slice_group, etp_group, *wide_groups]
    if isinstance(model_p, DTensor) and model_p.device_mesh.ndim == 1:
        groups.append(model_p.device_mesh.get_group())
    axes = tuple(cuts[c][:2] for c in ranked)
    order = tuple(ranked.index(c) for c in range(len(cuts)))  # the axes in the order they cut
    return Pieces(_group_over(ranks, groups, name), torch.Size(shape), axes, order)


def _dtensor_cuts(p, name: str, me: int) -> list:
    """(n, Shard dim or COPY, rank deltas) of each mesh dim of a DTensor that is sharded
    somewhere, in the order the layout cut it ([] for a plain tensor or a Replicate one: whole
    here). A _StridedShard (FSDP2 over tensor parallelism, the same dim) cuts the blocks the
    other mesh dims' Shards left along that dim: it comes after them."""
    from torch.distributed.tensor.placement_types import _StridedShard
    if not isinstance(p, DTensor) or not any(isinstance(pl, Shard) for pl in p.placements):
        return []
    mesh, coord, plain, strided = p.device_mesh, p.device_mesh.get_coordinate(), [], []
    for d, (pl, n) in enumerate(zip(p.placements, mesh.shape)):
        deltas = [int(r) - me for r in _along(mesh.mesh, coord, d)]
        if isinstance(pl, _StridedShard):
            before = math.prod(m for q, m in zip(p.placements, mesh.shape)
                               if type(q) is Shard and q.dim % p.dim() == pl.dim % p.dim())
            if pl.split_factor != before:
                raise ValueError(f"Muon matrix {name} is sharded as {p.placements}, whose strided "
                                 f"shard parallel/muon.py does not exchange")
            strided.append((n, pl.dim % p.dim(), deltas))
        elif type(pl) is Shard:
            plain.append((n, pl.dim % p.dim(), deltas))
        elif isinstance(pl, Replicate):
            plain.append((n, COPY, deltas))
        else:
            raise ValueError(f"Muon matrix {name} is sharded as {p.placements}, which "
                             f"parallel/muon.py does not exchange")
    return plain + strided


def _along(mesh_ranks, coord: list, d: int) -> list:
    """The ranks of a mesh along dim d through the rank at coord."""
    index = list(coord)
    index[d] = slice(None)
    return mesh_ranks[tuple(index)].tolist()


def _group_over(ranks: list, groups, name: str):
    """The group of `groups` whose rank i is ranks[i]."""
    for g in groups:
        if g is not None and dist.get_process_group_ranks(g) == list(ranks):
            return g
    raise ValueError(f"Muon matrix {name} is held in pieces over ranks {list(ranks)}, which no "
                     f"process group of the layout spans in that order")


def layout_groups(meshes) -> list:
    """The groups a matrix cut several ways is exchanged over: tp (a 2-D/2.5-D grid's ranks),
    pool (ZeRO-1/2's slices of tensor-parallel blocks) and, under expert tensor parallelism
    with expert data-parallel copies, edp x etp (ZeRO's slices or FSDP2's shards of the etp
    blocks; created here: collective, every rank calls it)."""
    from .mesh import expert_data_group
    groups = [meshes.group("tp"), meshes.group("pool")]
    if meshes.plan.etp > 1 and meshes.plan.edp > 1:
        groups.append(expert_data_group(meshes.plan))
    return groups


def for_layout(optimizer, model, zero_state, kinds: dict, comm_label=None, etp_group=None,
               wide_groups=(), device=None) -> PieceOwners:
    """The orthogonaliser of `optimizer` (a MuonAdamW, after prepare_optimizer) for `model`
    on this layout.

    zero_state: data_parallel.zero.ZeroState under ZeRO-1/2 (the optimizer then steps its flat
    slices), else None (DTensor shards and blocks, or whole matrices); kinds: {id(model
    param): "dense" | "pool" | "expert"} (parallel/kinds.py), for the order of the groups;
    etp_group: expert tensor parallelism's group (its banks' d_ff blocks), or None;
    wide_groups: layout_groups(meshes); device: the collectives' device (offload=optimizer
    steps host copies: their pieces travel through it)."""
    order = {"dense": 0, "pool": 1, "expert": 2}
    names = {id(p): n for n, p in model.named_parameters()}
    model_of = zero_state.model_param_of() if zero_state is not None else {}
    slice_group = {id(s): sl.group for sl in (zero_state.slices if zero_state is not None else ())
                   for s in sl.shards}
    pieces, ranked = {}, []
    for g in optimizer.param_groups:
        if not g.get("muon"):
            continue
        for p in g["params"]:
            model_p = model_of.get(id(p), p)
            d = pieces_of(model_p, names.get(id(model_p), ""), slice_group.get(id(p)), etp_group,
                          wide_groups)
            if d is None:
                continue
            pieces[id(p)] = d
            ranked.append((order[kinds.get(id(model_p), "dense")], len(ranked), d.group))
    groups = []
    for _, _, group in sorted(ranked, key=lambda t: t[:2]):
        if not any(group is g for g in groups):
            groups.append(group)
    return PieceOwners(pieces, groups, comm_label, device=device)
