"""ZeRO-1/2 slices described to DCP as pieces of the full tensors: a checkpoint writes each
rank's slices where they are and reads any layout's checkpoint straight back into them, so no
rank ever gathers a full master or optimizer state (the ZeRO paper's point, kept at save).

Shapes: L slice length, N the local parameter's numel, r this rank's index in the slice group.
A slice is the flat range [r L, min(r L + L, N)) of the local parameter (zero.py; the rest is
padding). A flat range of a row-major tensor is a union of rectangles -- at most a partial
innermost row, then blocks of whole rows, per dimension (`flat_blocks`) -- each a contiguous
run of the slice. Each rectangle becomes a shard of a ShardedTensor whose offsets are the
local parameter's own offset in the full tensor (a tensor-parallel DTensor's block, an
expert-parallel rank's experts) plus the rectangle's. DCP writes the shards (tp ranks holding
the same slice of a replicated parameter write it once) and, on load, fills them from
whatever pieces the checkpoint holds: full tensors, FSDP2 shards or other slices.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharding_spec import ShardingSpec


def flat_blocks(shape, start: int, stop: int) -> list:
    """[(offsets, sizes)] of the rectangles that make up flat positions [start, stop) of a
    row-major tensor of `shape`, in flat order (each a contiguous run)."""
    if start >= stop:
        return []
    if len(shape) == 0:  # a 0-dim tensor: its one element
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    (i0, r0), (i1, r1) = divmod(start, inner), divmod(stop, inner)
    row = lambda i, a, b: [((i, *o), (1, *s)) for o, s in flat_blocks(shape[1:], a, b)]  # noqa: E731
    if i0 == i1:
        return row(i0, r0, r1)
    out = []
    if r0:
        out += row(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *[0] * (len(shape) - 1)), (i1 - i0, *shape[1:])))
    if r1:
        out += row(i1, 0, r1)
    return out


def slice_shards(flat_L: torch.Tensor, local_shape, start: int, global_shape, offset):
    """A ShardedTensor of the full tensor (global_shape) holding this rank's slice: flat_L are
    the local parameter's flat positions [start, start + len) (padding beyond N dropped) and
    the local parameter sits at `offset` of the full tensor. None when the slice is all
    padding. The shards are views of flat_L: a load fills the slice in place."""
    n = math.prod(local_shape)
    stop = min(start + flat_L.numel(), n)
    pieces, pos = [], 0
    for offs, sizes in flat_blocks(tuple(local_shape), start, stop):
        k = math.prod(sizes)
        pieces.append(([o + b for o, b in zip(offs, offset)], flat_L[pos:pos + k].view(sizes)))
        pos += k
    return _sharded(pieces, global_shape) if pieces else None


def pieces_to_host(st: ShardedTensor, copy=None) -> ShardedTensor:
    """A copy of a slice_shards tensor in host memory (what an async save writes from);
    copy(tensor, i) makes piece i's copy (default: a plain one)."""
    copy = copy or (lambda t, i: t.to("cpu", copy=True))
    pieces = [(s.metadata.shard_offsets, copy(s.tensor, i)) for i, s in enumerate(st.local_shards())]
    return _sharded(pieces, st.metadata().size)


def _sharded(pieces: list, global_shape) -> ShardedTensor:
    """A ShardedTensor of the full tensor holding [(offsets, tensor)], this rank's pieces.
    Built as ShardedTensor._init_from_local_shards_and_global_metadata builds one, without
    its check that the listed shards cover the tensor (they are this rank's only)."""
    shards = [Shard(t, ShardMetadata(list(offs), list(t.shape), f"rank:{dist.get_rank()}/{t.device}"))
              for offs, t in pieces]
    dtype = pieces[0][1].dtype
    out = ShardedTensor.__new__(ShardedTensor, _LocalPieces([s.metadata for s in shards]),
                                torch.Size(global_shape), dtype=dtype, layout=torch.strided,
                                pin_memory=False, requires_grad=False)
    out._local_shards = shards
    out._prepare_init(process_group=None, init_rrefs=False)
    out._post_init()
    return out


class _LocalPieces(ShardingSpec):
    """This rank's pieces only. DCP reads a ShardedTensor's local shards and its full size
    (the other ranks describe their own pieces), while torch's stock specs check that the
    listed shards cover the whole tensor, which one rank's view cannot."""

    def __init__(self, shards_metadata: list):
        self.shards_metadata = shards_metadata

    def build_metadata(self, tensor_sizes, tensor_properties) -> ShardedTensorMetadata:
        return ShardedTensorMetadata(self.shards_metadata, tensor_sizes, tensor_properties)

    def shard(self, tensor, src_rank: int = 0, process_group=None):
        raise NotImplementedError("ZeRO slices are described, never scattered (zero.py slices)")
