"""ZeRO-3 through FSDP2 `fully_shard`: experts over edp, routers and shared experts over the
token pool, blocks and roots over dp (the groups of grad_sync.py), gradients divided by dp.

The ZeRO family rides on FSDP2's own extension points: offload='params' is its
CPUOffloadPolicy (pinned when CUDA exists), hpZ its reshard_after_forward=<ranks> (after
forward each module keeps a shard over `zeropp_hpz` consecutive ranks of its group, so the
backward re-gather stays inside that node), qwZ/qgZ its custom all-gather / reduce-scatter
(zeropp.py).
"""
import torch
from torch.distributed.tensor import DTensor

from moe import MoELayer
from moe.experts import ExpertBank

from ..dtensors import local


def apply_fsdp(model, meshes, blocks, roots=None, mp_policy=None, comm_label=None) -> None:
    """fully_shard experts over edp, other MoE params over pool, blocks and roots over dp.

    roots: the modules whose forward is called (default [model]); with several pipeline
    stages per rank these are the stage shells, each its own FSDP2 root. comm_label(kind):
    the ledger's context manager, for the quantized collectives (zeropp.py).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.fsdp import fully_shard as _fully_shard

    from .offload import pinning
    from .zeropp import fsdp_comms
    mp_policy = mp_policy or MixedPrecisionPolicy()
    plan = meshes.plan
    offload = CPUOffloadPolicy(pin_memory=pinning()) if plan.offload == "params" else OffloadPolicy()
    gather, scatter = fsdp_comms(plan.zeropp_quantize_weights, plan.zeropp_quantize_grads, comm_label)

    def fully_shard(module, mesh, mp_policy):  # every FSDP2 call: the shard dim, the ZeRO family
        n = mesh.size()
        hpz = _hpz_for(module, n, plan.zeropp_hpz)
        if hpz:  # FSDP2's secondary shard needs dim-0 sharding: other params get their own unit
            for sub in _other_dim_owners(module, n):
                fully_shard(sub, mesh, mp_policy)
        out = _fully_shard(module, mesh=mesh, mp_policy=mp_policy, offload_policy=offload,
                           reshard_after_forward=hpz, shard_placement_fn=_shard_dim_for(n))
        if n > 1 and gather is not None:
            out.set_custom_all_gather(gather)
        if n > 1 and scatter is not None:
            out.set_custom_reduce_scatter(scatter)
        return out

    edp, pool, dp = meshes.expert["edp"], meshes.pool["pool"], meshes.dense["dp"]
    for mod in model.modules():
        if isinstance(mod, MoELayer):
            rest = [m for m in (mod.router, mod.shared_experts) if m is not None]
            for m, on in [(mod.experts, edp)] + [(m, pool) for m in rest]:
                _check_one_rank_dtype(m, on, mp_policy, plan.replicas)
                fully_shard(m, mesh=on, mp_policy=mp_policy)
                _divide_by(m, on, plan.replicas)
    for block in blocks:
        fully_shard(block, mesh=dp, mp_policy=mp_policy)
    for bank in model.modules():  # weights gathered per forward: cast after each gather
        if isinstance(bank, ExpertBank):
            bank.set_cast_cache(False)
    for root in roots or [model]:
        fully_shard(root, mesh=dp, mp_policy=mp_policy)
    if plan.zero_prefetch:
        set_prefetch(blocks, plan.zero_prefetch)
    if plan.a2a_overlap == "1f1b":
        hold_gathered(model)
    for mod in model.modules():
        if isinstance(mod, MoELayer) and mod.a2a_overlap_degree > 1 and plan.a2a_overlap != "1f1b":
            _gather_once_per_layer(mod)


def _gather_once_per_layer(layer) -> None:
    """moe.a2a_overlap_degree = d > 1 runs the experts once per chunk: FSDP2 would gather
    them d times per layer in forward and again in backward. Hold them gathered across the
    chunks and free them when the layer is done with them (MoELayer.set_experts_release)."""
    _hold(layer.experts)
    layer.set_experts_release(layer.experts.reshard)


def hold_gathered(model) -> None:
    """parallel.a2a_overlap=1f1b: the forward of one micro-batch runs beside the backward of
    another, so a unit must not free its gathered parameters after either (the other may be
    using them): each unit gathers once per step and is resharded by `reshard_all` after the
    step's last backward (memory: the step's units stay gathered, as ZeRO-2's parameters)."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            _hold(m)


def _hold(unit) -> None:
    """Keep `unit`'s gathered parameters after its forward and its backward (freed by an
    explicit reshard())."""
    unit.set_reshard_after_forward(False, recurse=False)
    unit.set_reshard_after_backward(False, recurse=False)


def reshard_all(model) -> None:
    """Free every unit's gathered parameters (after hold_gathered's step): the optimizer
    updates the shards, so the next forward must gather again."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def set_prefetch(blocks, n: int) -> None:
    """parallel.zero_prefetch = n: when block i's parameters are gathered, FSDP2 also issues
    the all-gathers of blocks i+1..i+n in forward (i-1..i-n in backward), each with the FSDP
    units inside it (experts, routers): their communication runs while block i computes.
    Memory: up to n more blocks' unsharded parameters are alive at once (FSDP2's implicit
    default, n = 0 here, keeps one block ahead)."""
    from torch.distributed.fsdp import FSDPModule

    def units(block):  # the block's own unit first, then those inside it, in forward order
        return [m for m in block.modules() if isinstance(m, FSDPModule)]
    for i, block in enumerate(blocks):
        ahead = [u for b in blocks[i + 1:i + 1 + n] for u in units(b)]
        behind = [u for b in reversed(blocks[max(0, i - n):i]) for u in units(b)]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)


def _hpz_for(module, n: int, hpz: int):
    """The post-forward shard size for `module` on an n-rank mesh, or None (FSDP2 default):
    hpZ applies where the mesh spans more than one node of `hpz` ranks and the module's own
    parameters shard on dim 0 (FSDP2's secondary shard assumes it)."""
    if not hpz or n <= hpz or n % hpz:
        return None
    held = {id(p) for p in _managed(module)}
    if not all(_dim0(p, n) for p in module.parameters(recurse=False) if id(p) in held):
        return None  # e.g. fewer local experts than ranks: this unit frees after forward
    return hpz


def _managed(module) -> list:
    """The parameters fully_shard(module) would own: those no FSDP2 descendant holds yet."""
    from torch.distributed.fsdp import FSDPModule
    held = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule)
            for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in held]


def _other_dim_owners(module, n: int) -> list:
    """Submodules (not module itself, not yet sharded) directly owning a parameter that
    _shard_dim_for would split on a dim other than 0 (e.g. a [1, D, F] dense FFN)."""
    from torch.distributed.fsdp import FSDPModule
    ids = {id(p) for p in _managed(module) if not _dim0(p, n)}
    out = []
    for m in module.modules():
        if m is not module and not isinstance(m, FSDPModule) and \
                any(id(p) in ids for p in m.parameters(recurse=False)):
            out.append(m)
    return out


def _dim0(p, n: int) -> bool:
    shape = local(p).shape if isinstance(p, DTensor) else p.shape
    return len(shape) == 0 or shape[0] >= n


def _check_one_rank_dtype(module, mesh, mp_policy, dp: int) -> None:
    """FSDP2 (torch 2.13) divides a one-rank mesh's gradients by the factor twice when it
    reduces in a dtype other than fp32/bf16 (its pre/post split for fp16/fp64, then the
    one-rank copy's own division): measured, fp64 experts on edp = 1 under dp = 2 got half
    their gradient. Refused instead of training on wrong gradients."""
    p = next(module.parameters(), None)
    reduce = mp_policy.reduce_dtype or (p.dtype if p is not None else None)
    if mesh.size() == 1 and dp > 1 and reduce not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"parallel.zero=3 with a {reduce} reduction on a one-rank group (here "
                         f"{type(module).__name__}'s): FSDP2 would divide its gradients by "
                         f"dp={dp} twice; use parallel.zero <= 2, fp32/bf16 parameters, or a "
                         f"layout whose expert-data-parallel degree (dp*tp/(ep*etp)) is > 1")


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
        if _dim0(p, n):
            return Shard(0)
        return Shard(max(range(len(shape)), key=lambda d: shape[d]))
    return choose
