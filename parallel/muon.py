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

The pieces (Pieces.split):
  flat  ZeRO-1/2: the matrix flattened, zero-padded to P*L and cut in P rows of L
        (data_parallel/zero.py's slices);
  dim   a DTensor on a 1-D mesh with Shard(dim): torch.chunk's pieces along dim (the last ones
        shorter or empty), as FSDP2 (ZeRO-3) and 1-D tensor parallelism shard parameters; and
        expert tensor parallelism's d_ff blocks of an expert bank over the etp group (plain
        tensors, equal blocks: moe/expert_tp.py).
A DTensor with Replicate holds the whole matrix: orthogonalised where it is (every replica
computes the same). Matrices no group splits (one rank's expert bank under plain expert
parallelism) stay on their rank.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

KIND = "muon_orthogonalise"


@dataclass(frozen=True)
class Pieces:
    """How a group's ranks hold pieces of one matrix (or bank) of `shape`."""
    group: object
    shape: torch.Size
    split: str   # "flat" or "dim"
    dim: int = 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def _rows(self) -> list:
        """split="dim": each rank's length along dim (torch.chunk's: the last ones shorter or 0)."""
        n = self.shape[self.dim]
        chunk = -(-n // self.size)
        return [max(0, min(chunk, n - r * chunk)) for r in range(self.size)]

    def numels(self) -> list:
        """Each rank's piece numel."""
        total = math.prod(self.shape)
        if self.split == "flat":
            return [-(-total // self.size)] * self.size
        per_row = total // max(1, self.shape[self.dim])
        return [rows * per_row for rows in self._rows()]

    def assemble(self, flat_pieces: list) -> torch.Tensor:
        """The whole matrix from every rank's flat piece (trimmed of its padding)."""
        if self.split == "flat":
            return torch.cat(flat_pieces)[:math.prod(self.shape)].view(self.shape)
        blocks = []
        for piece, rows, numel in zip(flat_pieces, self._rows(), self.numels()):
            shape = list(self.shape)
            shape[self.dim] = rows
            blocks.append(piece[:numel].view(shape))
        return torch.cat(blocks, self.dim)

    def cut(self, whole: torch.Tensor) -> list:
        """Every rank's flat piece of `whole`."""
        if self.split == "flat":
            L = self.numels()[0]
            flat = whole.reshape(-1)
            flat = torch.cat([flat, flat.new_zeros(self.size * L - flat.numel())])
            return list(flat.view(self.size, L))
        return [part.reshape(-1) for part in whole.split(self._rows(), self.dim)]


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
    P) chooses the owners (bench/muon.py compares a single owner)."""
    group = pieces[0].group
    P, me = dist.get_world_size(group), dist.get_rank(group)
    if P == 1:  # a group of one (e.g. expert banks with no data-parallel copies): no exchange
        return [d.cut(ns(d.assemble([u.reshape(-1)])).to(u.dtype))[0] for d, u in zip(pieces, updates)]
    own = assign([d.shape for d in pieces], P)
    pad = [max(d.numels()) for d in pieces]
    mine = [i for i in range(len(pieces)) if own[i] == me]
    dtype, device = updates[0].dtype, updates[0].device

    def padded(t, n):
        flat = t.reshape(-1).to(dtype)
        return torch.cat([flat, flat.new_zeros(n - flat.numel())]) if flat.numel() < n else flat

    to_owner = [sum(pad[i] for i in range(len(pieces)) if own[i] == o) for o in range(P)]
    send = torch.cat([padded(updates[i], pad[i]) for o in range(P) for i in range(len(pieces)) if own[i] == o]
                     or [torch.zeros(0, dtype=dtype, device=device)])
    from_each = [sum(pad[i] for i in mine)] * P
    recv = send.new_empty(sum(from_each))
    dist.all_to_all_single(recv, send, from_each, to_owner, group=group)

    back = [[] for _ in range(P)]  # per destination rank, in `mine` order
    rows = recv.split(from_each)
    for k, i in enumerate(mine):
        offset = sum(pad[j] for j in mine[:k])
        whole = pieces[i].assemble([row[offset:offset + pad[i]] for row in rows])
        for r, piece in enumerate(pieces[i].cut(ns(whole).to(dtype))):
            back[r].append(padded(piece, pad[i]))
    send_back = torch.cat([t for r in range(P) for t in back[r]] or [send.new_zeros(0)])
    recv_back = send.new_empty(sum(to_owner))
    dist.all_to_all_single(recv_back, send_back, to_owner, from_each, group=group)

    out, cursor = [None] * len(pieces), {o: 0 for o in range(P)}
    starts = [sum(to_owner[:o]) for o in range(P)]
    for i in range(len(pieces)):
        o = own[i]
        begin = starts[o] + cursor[o]
        cursor[o] += pad[i]
        out[i] = recv_back[begin:begin + pieces[i].numels()[me]]
    return out


class PieceOwners:
    """MuonAdamW's orthogonaliser for a layout that holds pieces of matrices.

    pieces: {id(optimizer param): Pieces} for the parameters held in pieces; groups: the
    process groups in the order every rank exchanges them (a fixed kind order: dense, pool,
    expert, so no two ranks wait on each other's groups in opposite orders); comm_label(kind):
    the ledger's labelling context (or None)."""

    def __init__(self, pieces: dict, groups: list, comm_label=None, assign=owners):
        self.pieces, self.groups, self.comm_label, self.assign = pieces, groups, comm_label, assign

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
                if not ks:
                    continue
                locals_ = [_local(updates[k]) for k in ks]
                done = exchange([self.pieces[id(params[k])] for k in ks], locals_, ns, self.assign)
                for k, loc, flat in zip(ks, locals_, done):
                    out[k] = _like(updates[k], flat.view(loc.shape))
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


def pieces_of(model_p, name: str, slice_group=None, etp_group=None) -> "Pieces | None":
    """How the layout holds Muon matrix `model_p` (`name` in the model): ZeRO-1/2's flat slices
    over slice_group, expert tensor parallelism's d_ff blocks over etp_group, a DTensor's shards;
    None when it is whole on this rank."""
    from moe.expert_tp import FFN_DIMS
    from .dtensors import local
    from .kinds import is_expert_param
    if slice_group is not None:
        return Pieces(slice_group, local(model_p).shape, "flat")
    pname = name.rpartition(".")[2]
    if etp_group is not None and is_expert_param(name) and pname in FFN_DIMS:
        shape = list(model_p.shape)
        shape[FFN_DIMS[pname]] *= dist.get_world_size(etp_group)
        return Pieces(etp_group, torch.Size(shape), "dim", FFN_DIMS[pname])
    return dtensor_pieces(model_p)


def dtensor_pieces(p) -> "Pieces | None":
    """A DTensor parameter sharded on a 1-D mesh: its Pieces; None when it is whole on every
    rank (Replicate, or not a DTensor). ValueError for shardings the exchange does not
    handle (several mesh dims, partial values)."""
    if not isinstance(p, DTensor):
        return None
    shards = [pl for pl in p.placements if isinstance(pl, Shard)]
    if not shards or p.device_mesh.size() == 1:  # whole here
        return None
    if p.device_mesh.ndim != 1 or len(p.placements) != 1:
        raise ValueError(f"a Muon matrix sharded as {p.placements} over a {p.device_mesh.ndim}-D mesh")
    return Pieces(p.device_mesh.get_group(), p.shape, "dim", shards[0].dim % p.dim())


def for_layout(optimizer, model, zero_state, kinds: dict, comm_label=None, etp_group=None) -> PieceOwners:
    """The orthogonaliser of `optimizer` (a MuonAdamW, after prepare_optimizer) for `model`
    on this layout.

    zero_state: data_parallel.zero.ZeroState under ZeRO-1/2 (the optimizer then steps its flat
    slices), else None (DTensor shards and blocks, or whole matrices); kinds: {id(model
    param): "dense" | "pool" | "expert"} (parallel/kinds.py), for the order of the groups;
    etp_group: expert tensor parallelism's group (its banks' d_ff blocks), or None."""
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
            d = pieces_of(model_p, names.get(id(model_p), ""), slice_group.get(id(p)), etp_group)
            if d is None:
                continue
            pieces[id(p)] = d
            ranked.append((order[kinds.get(id(model_p), "dense")], len(ranked), d.group))
    groups = []
    for _, _, group in sorted(ranked, key=lambda t: t[:2]):
        if not any(group is g for g in groups):
            groups.append(group)
    return PieceOwners(pieces, groups, comm_label)
