"""ZeRO-3 through FSDP2 `fully_shard`: experts over edp, routers and shared experts over the
token pool, blocks and roots over dp (the groups of grad_sync.py), gradients divided by dp.
"""
from torch.distributed.tensor import DTensor

from moe import MoELayer

from .dtensors import local


def apply_fsdp(model, meshes, blocks, roots=None, mp_policy=None) -> None:
    """fully_shard experts over edp, other MoE params over pool, blocks and roots over dp.

    roots: the modules whose forward is called (default [model]); with several pipeline
    stages per rank these are the stage shells, each its own FSDP2 root.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as _fully_shard
    mp_policy = mp_policy or MixedPrecisionPolicy()
    plan = meshes.plan

    def fully_shard(module, mesh, mp_policy):  # all FSDP2 calls pick the shard dim below
        return _fully_shard(module, mesh=mesh, mp_policy=mp_policy,
                            shard_placement_fn=_shard_dim_for(mesh.size()))

    edp, pool, dp = meshes.expert["edp"], meshes.pool["pool"], meshes.dense["dp"]
    for mod in model.modules():
        if isinstance(mod, MoELayer):
            fully_shard(mod.experts, mesh=edp, mp_policy=mp_policy)
            _divide_by(mod.experts, edp, plan.dp)
            rest = [m for m in (mod.router, mod.shared_experts) if m is not None]
            for m in rest:
                fully_shard(m, mesh=pool, mp_policy=mp_policy)
                _divide_by(m, pool, plan.dp)
    for block in blocks:
        fully_shard(block, mesh=dp, mp_policy=mp_policy)
    for root in roots or [model]:
        fully_shard(root, mesh=dp, mp_policy=mp_policy)


def _divide_by(fsdp_module, mesh, dp: int) -> None:
    # reduce-scatter sums, then divides by dp (not by the mesh size). Sum-only collectives
    # because gloo has no PREMUL_SUM; but not on a 1-rank mesh, where FSDP2 then skips the
    # division along with the (absent) collective.
    fsdp_module.set_gradient_divide_factor(float(dp))
    if mesh.size() > 1:
        fsdp_module.set_force_sum_reduction_for_comms(True)


def _shard_dim_for(n: int):
    """FSDP2 shards dim 0 by default; a [1, D, F] dense-FFN weight (or fewer local experts than
    ranks) would then sit whole on one rank, so such tensors are split on their largest dim."""
    from torch.distributed.tensor import Shard

    def choose(p):
        shape = local(p).shape if isinstance(p, DTensor) else p.shape
        if len(shape) == 0 or shape[0] >= n:
            return Shard(0)
        return Shard(max(range(len(shape)), key=lambda d: shape[d]))
    return choose
