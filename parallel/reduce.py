"""The one flatten / all-reduce / copy-back loop, and the reductions built on it.

Shapes: E experts. Used for gradients (parallel/data_parallel/grad_sync.py), expert loads for the
aux-loss-free bias update, routing statistics for logging, and per-rank scalars.
"""
import torch
import torch.distributed as dist

from moe.stats import RoutingStats


def all_reduce_flat(tensors: list, group=None, divisor: float = 1.0) -> None:
    """In place: each tensor becomes (its sum over `group`) / divisor.

    One all-reduce per dtype over a flat copy (fewer, larger messages). A group of one
    rank skips the communication (the division still applies).
    """
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            if divisor != 1:
                flat.div_(divisor)
            for t, chunk in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(chunk.view_as(t))


def sum_routing_stats(stats: RoutingStats, group) -> RoutingStats:
    """A RoutingStats summed over the ranks of `group` (ranks that route distinct tokens).

    Counts are summed, entropy becomes the token-weighted mean. One all-reduce of a packed
    float64 tensor (exact for counts below 2**53). rank_rows (and rank_rows_unreplicated)
    are kept as this rank holds them: they already cover its whole expert-parallel group.
    """
    E = stats.routed_E.numel()
    n_tokens = torch.tensor([stats.num_tokens, float(stats.entropy) * stats.num_tokens],
                            dtype=torch.float64, device=stats.routed_E.device)
    packed = torch.cat([stats.routed_E.double(), stats.kept_E.double(), n_tokens])
    all_reduce_flat([packed], group)
    n = int(packed[2 * E])
    return RoutingStats(routed_E=packed[:E].round().long(), kept_E=packed[E:2 * E].round().long(),
                        num_tokens=n, top_k=stats.top_k,
                        entropy=(packed[2 * E + 1] / max(n, 1)).float(),
                        rank_rows=stats.rank_rows, rank_rows_unreplicated=stats.rank_rows_unreplicated)


# torch 2.13 names the single-tensor gather all_gather_single and warns on every call of its
# old name (FutureWarning, once per process and call site: 16 lines in a 16-rank log); torch
# before 2.13 (2.11 on the GPU machine) has only the old name. Same arguments either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
