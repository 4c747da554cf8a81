"""Expert parallelism applied from outside: shard every MoE layer's experts over a group,
and the checkpoint view that lets DCP reshard expert slices to any other layout.

Shapes: E experts, P ranks of the expert-parallel group, L = E/P local experts.
Rank r of P keeps global experts [r*L, (r+1)*L) of every MoE layer; tokens reach them by the
all-to-all of moe/ep_dispatcher.py. Groups come from parallel/mesh.py (the "ep" dim);
gradient reduction of the expert slices (over "edp") is parallel/grad_sync.py's.
A layer built with replica_slots=R > 0 also serves replicas of each step's hottest experts
(moe/placement.py, moe/ep_dispatcher.py): fetched from the owners every forward, their
gradients summed into the owners in backward, so nothing here (checkpoints, gradient sync)
sees them.
"""
import torch

from moe.aux import moe_layers
from moe.ep_dispatcher import EXPERT_PARAM_ATTR, check_shardable, shard_layer_experts
from moe.expert_tp import FFN_DIMS, check_ffn_shardable, split_layer_ffn

from .dtensors import like_param

__all__ = ["apply_expert_parallel", "apply_expert_tensor_parallel", "is_expert_param",
           "expert_checkpoint_transforms"]


def is_expert_param(name_or_param) -> bool:
    """True for parameters of an MoE layer's expert bank (not router, not shared experts).

    A parameter is recognized by the mark set when sharding; a name by a path component
    equal to "experts" (e.g. "blocks.0.ffn.experts.w1"), which also works before sharding
    and after wrappers that replace parameter objects.
    """
    if isinstance(name_or_param, str):
        return "experts" in name_or_param.split(".")
    return bool(getattr(name_or_param, EXPERT_PARAM_ATTR, False))


def apply_expert_parallel(model, ep_group) -> list:
    """Shard the experts of every MoELayer in `model` over `ep_group` (in place).

    The model must hold full, identical weights on all ranks (or still be on the meta
    device); each rank keeps its slice. All layers are checked before any is changed.
    Returns [(name, layer)]. Their all-to-all bytes are counted by parallel/ledger.py.
    """
    return _every_layer(model, ep_group, check_shardable, shard_layer_experts,
                        "expert parallelism", "ep")


def apply_expert_tensor_parallel(model, etp_group) -> list:
    """Split every MoELayer's experts' d_ff over `etp_group` (in place; moe/expert_tp.py):
    rank j keeps block j of w1/w3 columns and w2 rows. All layers are checked before any is
    changed. Returns [(name, layer)]."""
    return _every_layer(model, etp_group, check_ffn_shardable, split_layer_ffn,
                        "expert tensor parallelism", "etp")


def _every_layer(model, group, check, change, what: str, field: str) -> list:
    """check(layer, group) every MoELayer (errors name the layer), then change(layer, group)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{what}: the model has no MoELayer; use parallel.{field}=1 for a dense model")
    for name, layer in layers:
        try:
            check(layer, group)
        except ValueError as e:
            raise ValueError(f"{name or 'the layer'}: {e}") from None
    for _, layer in layers:
        change(layer, group)
    return layers


def expert_checkpoint_transforms(model, meshes):
    """(transform, untransform) of (model_sd, optim_sd) for checkpoint save/load.

    Under expert parallelism each rank holds experts [r*L, (r+1)*L) of every MoE layer as a
    plain local tensor under the full tensor's name. Wrapped as DTensors over the (edp, ep)
    mesh (Shard(0) over ep, replicated over edp), DCP records the full [E, ...] tensors and
    reshards them for any other layout; untransform unwraps them again.

    Under expert tensor parallelism (etp > 1) each expert's d_ff is split too: the etp dim of
    the mesh adds Shard(d_ff dim) (moe/expert_tp.py FFN_DIMS), so the checkpoint still holds
    whole experts and loads under any other etp.

    Under ZeRO-3 those local experts are themselves FSDP2 DTensors sharded over edp (dim d of
    [L, ...]); they are wrapped over the stage's (ep, etp, edp) mesh as [Shard(0), etp's
    placement, Shard(d)]: ep picks the block of L experts first, then etp the d_ff block, then
    edp the FSDP chunk inside it (a mesh built without process groups: DCP needs only each
    rank's coordinates). untransform gives back DTensors laid out like the parameter, on the
    same local storage.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    plan = meshes.plan
    mesh = meshes.expert["edp", "ep", "etp"]
    params = {f"{lname}.experts.{pname}": p for lname, layer in moe_layers(model)
              for pname, p in layer.experts.named_parameters()}
    ep_edp = _ep_major_mesh(meshes) if any(isinstance(p, DTensor) for p in params.values()) else None

    def wrap(name, t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        pname = name.rpartition(".")[2]
        ffn_dim = FFN_DIMS.get(pname) if plan.etp > 1 else None
        shape = [t.shape[0] * plan.ep, *t.shape[1:]]
        if ffn_dim is not None:
            shape[ffn_dim] *= plan.etp
        stride = torch.empty(shape, device="meta").stride()
        etp = Replicate() if ffn_dim is None else Shard(ffn_dim)
        if isinstance(t, DTensor):  # ZeRO-3: an FSDP2 shard (over edp) of the local experts
            (fsdp,) = t.placements
            return DTensor.from_local(t.to_local(), ep_edp, [Shard(0), etp, fsdp], run_check=False,
                                      shape=tuple(shape), stride=stride)
        return DTensor.from_local(t, mesh, [Replicate(), Shard(0), etp], run_check=False,
                                  shape=tuple(shape), stride=stride)

    def unwrap(name, t):
        if not isinstance(t, DTensor):
            return t
        return like_param(t.to_local(), params[name])

    def transform(model_sd, optim_sd):
        model_sd = {k: wrap(k, v) if k in params else v for k, v in model_sd.items()}
        state = {k: ({n: wrap(k, v) for n, v in st.items()} if k in params else st)
                 for k, st in optim_sd["state"].items()}
        return model_sd, {**optim_sd, "state": state}

    def untransform(model_sd, optim_sd):
        model_sd = {k: unwrap(k, v) if k in params else v for k, v in model_sd.items()}
        state = {k: ({n: unwrap(k, v) for n, v in st.items()} if k in params else st)
                 for k, st in optim_sd["state"].items()}
        return model_sd, {**optim_sd, "state": state}

    return transform, untransform


def _ep_major_mesh(meshes):
    """This stage's ranks as an (ep, etp, edp) DeviceMesh, without creating process groups."""
    from torch.distributed.device_mesh import DeviceMesh
    plan = meshes.plan
    grid = torch.arange(plan.world).reshape(plan.pp, plan.edp, plan.ep, plan.etp)[meshes.pp_rank]
    return DeviceMesh(meshes.expert.device_type, grid.permute(1, 2, 0).contiguous(),
                      mesh_dim_names=("ep", "etp", "edp"), _init_backend=False)
