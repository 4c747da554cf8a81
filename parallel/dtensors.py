"""Facts about a parameter or gradient that may be a DTensor (tp, FSDP2) or a plain tensor."""
import math

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard


def local(t):
    """The rank-local tensor: t.to_local() for a DTensor, else t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_pieces(t) -> int:
    """Into how many pieces the DTensor placements of `t` cut it (1 for a plain tensor)."""
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements)
                     if isinstance(pl, (Shard, _StridedShard)))


def like_param(t, p):
    """t, a local tensor laid out like p's local piece, as a DTensor with p's mesh, placements
    and global shape (no copy, no communication); t itself when p is a plain tensor."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())
