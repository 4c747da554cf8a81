"""Each layout's checkpoint transform, in one place: the layout-free form a checkpoint holds
(full tensors, each under one name) and the way back into this rank's layout.

    state = layout_state(par, optimizer)           # {"model", "optim"}: what DCP saves
    state = layout_state(par, optimizer, for_load=True); dcp.load(state, ...)
    set_layout_state(par, optimizer, state)        # into the model, optimizer, ZeRO slices
    weights_state(par) / set_weights_state(par, model_sd)   # the model weights only

The transforms, applied in this order (and undone in reverse):
  tied     a weight tied across pipeline stages is saved once, as tok_emb.weight
  expert   expert-parallel (and expert-tensor-parallel) slices are wrapped as DTensors of the
           full [E, ...] tensor, so DCP reshards them for any other ep/etp
  2bw      PipeDream-2BW's gradient not yet applied rides along (OPTIONAL_PREFIXES: loaded
           only when the checkpoint has it)
ZeRO-1/2's optimizer steps private flat slices: its state (and, under bf16 parameters, the
fp32 masters in the parameters' places) is described to DCP as this rank's pieces of the
name-keyed, parameter-shaped tensors the other layouts save (data_parallel/zero_shards.py):
written where it lies, loaded straight back into the slices, never gathered. ZeRO-3 with
offload=optimizer keeps its state shaped like the FSDP2 shards, saved as DTensors.
trainer/checkpoint.py writes and reads the files; it knows none of this.
"""
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from moe.aux import moe_layers
from moe.expert_tp import FFN_DIMS

from .data_parallel.zero_shards import slice_shards
from .dtensors import like_param, local

PENDING, FLAG = "pipeline_2bw_pending_grad.", "_present"
OPTIONAL_PREFIXES = (PENDING,)  # entries only some layouts save (2bw's pending gradient)
NO_OPTIM = {"state": {}, "param_groups": []}


# ------------------------------------------------------------------ the composed transform
def transforms(par):
    """(transform, untransform) of (model_sd, optim_sd) for this rank's layout."""
    steps = []
    if par.tied is not None:
        steps.append(_tied(par.tied))
    if par.meshes is not None and (par.plan.ep > 1 or par.plan.etp > 1):
        steps.append(_experts(par.model, par.meshes))
    if par.plan.pp > 1 and par.plan.pp_schedule == "2bw":
        steps.append(_twobw(par.pipeline))

    def transform(model_sd, optim_sd):
        for fwd, _ in steps:
            model_sd, optim_sd = fwd(model_sd, optim_sd)
        return model_sd, optim_sd

    def untransform(model_sd, optim_sd):
        for _, back in reversed(steps):
            model_sd, optim_sd = back(model_sd, optim_sd)
        return model_sd, optim_sd

    return transform, untransform


def layout_state(par, optimizer, for_load: bool = False) -> dict:
    """{"model", "optim"} state dicts in the layout-free form (no communication; for_load:
    the tensors a DCP load fills in place)."""
    model, zero = par.model, par.zero
    if zero is None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    else:
        if for_load:
            zero.init_optimizer_state(optimizer)  # the load fills existing state tensors
        model_sd = get_model_state_dict(model)
        if _slices(zero):
            blocks = _global_blocks(par)
            optim_sd = _zero_optim_pieces(model, optimizer, zero, blocks)
            _check_names(optim_sd, model_sd)
            model_sd = _with_master_pieces(model, zero, model_sd, blocks)
        else:
            optim_sd = _zero_optim_state(model, optimizer, zero)
            _check_names(optim_sd, model_sd)
    transform, _ = transforms(par)
    model_sd, optim_sd = transform(model_sd, optim_sd)
    return {"model": model_sd, "optim": optim_sd}


def set_layout_state(par, optimizer, state: dict) -> None:
    """Put a loaded layout_state back: model, optimizer (ZeRO-1/2: the slices were loaded in
    place; the parameters then come from the masters, or the slices from the parameters)."""
    _, untransform = transforms(par)
    model_sd, optim_sd = untransform(state["model"], state["optim"])
    if par.zero is None:
        set_state_dict(par.model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    if _slices(par.zero):
        _set_model_and_slices(par, model_sd)
        _set_zero_optim_pieces(par.model, optimizer, par.zero, optim_sd)
    else:
        set_model_state_dict(par.model, model_sd)
        _set_zero_optim_state(par.model, optimizer, par.zero, optim_sd)
        par.zero.refresh_from_params()


def _check_names(optim_sd: dict, model_sd: dict) -> None:
    missing = [k for k in optim_sd["state"] if k not in model_sd]
    if missing:
        raise RuntimeError(f"ZeRO optimizer state names {missing[:3]} are not model state "
                           f"names; state_dict._param_name must map them")


def _named(model):
    return model.named_parameters(remove_duplicate=False)


def _slices(zero) -> bool:
    """ZeRO-1/2's flat slices (zero.ZeroState), not ZeRO-3 offload's shard-shaped masters."""
    return zero.stage in (1, 2)


def _set_model_and_slices(par, model_sd: dict) -> None:
    """Collective under bf16 parameters (the masters, loaded into the slices, gathered into
    the parameters); else the loaded parameters and the master slices copied from them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    plain = {k: v for k, v in model_sd.items() if not isinstance(v, ShardedTensor)}
    set_model_state_dict(par.model, plain, options=StateDictOptions(strict=False))
    if par.zero.holds_masters():
        par.zero.gather_params()
    else:
        par.zero.refresh_from_params()


def _global_blocks(par) -> dict:
    """{id(local parameter): (full shape, offset of the local tensor in it)}: tensor-parallel
    DTensors' blocks, expert-parallel ranks' experts (as _experts wraps them), else whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    wrap = None
    if par.meshes is not None and (par.plan.ep > 1 or par.plan.etp > 1):
        _, wrap = _expert_wrapper(par.model, par.meshes)
    experts = {id(p): f"{lname}.experts.{pname}" for lname, layer in moe_layers(par.model)
               for pname, p in layer.experts.named_parameters()}
    out = {}
    for p in par.model.parameters():
        t, d = local(p), p if isinstance(p, DTensor) else None
        if wrap is not None and id(p) in experts:
            d = wrap(experts[id(p)], torch.empty(t.shape, dtype=t.dtype, device="meta"))
        if d is None:
            out[id(p)] = (tuple(t.shape), (0,) * t.dim())
        else:
            _, offset = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
            out[id(p)] = (tuple(d.shape), tuple(offset))
    return out


def _pieces_of(flat, p, start, blocks):
    shape, offset = blocks[id(p)]
    return slice_shards(flat, tuple(local(p).shape), start, shape, offset)


def _with_master_pieces(model, zero, model_sd: dict, blocks: dict) -> dict:
    """Under bf16 parameters (fp32 masters in ZeRO-1/2 slices): each parameter's entry is its
    master's slice (zero_shards.py), dropped where this rank's slice is all padding."""
    if not zero.holds_masters():
        return model_sd
    out, names = dict(model_sd), {}
    for name, p in _named(model):
        names.setdefault(id(p), []).append(_param_name(name))  # as get_model_state_dict names
    for p, master, start, _ in zero.pieces():
        pieces = _pieces_of(master.detach(), p, start, blocks)
        for name in names.get(id(p), []):
            if name in out:
                out.pop(name)
                if pieces is not None:
                    out[name] = pieces
    return out


def weights_state(par) -> dict:
    """The model weights alone in the layout-free form, to load into (set_weights_state)."""
    transform, _ = transforms(par)
    model_sd = get_model_state_dict(par.model)
    if par.zero is not None and _slices(par.zero):
        model_sd = _with_master_pieces(par.model, par.zero, model_sd, _global_blocks(par))
    return transform(model_sd, NO_OPTIM)[0]


def set_weights_state(par, model_sd: dict) -> None:
    """The loaded weights into the model and, under ZeRO-1/2 (and ZeRO-3 offload), into the
    master copies the optimizer steps (else its first step would write the old ones back)."""
    _, untransform = transforms(par)
    model_sd = untransform(model_sd, NO_OPTIM)[0]
    if par.zero is not None and _slices(par.zero):
        _set_model_and_slices(par, model_sd)
        return
    set_model_state_dict(par.model, model_sd)
    if par.zero is not None:
        par.zero.refresh_from_params()


# ------------------------------------------------------------------ tied embeddings
def _tied(tied):
    """Save the weight once, as tok_emb.weight, whichever stage holds it; load it back into
    every holder (parallel/pipeline/tied.py)."""
    canon, alias = tied.CANONICAL, tied.ALIAS
    rename = tied.last and not tied.first   # the last stage holds it as lm_head.weight

    def names(sd, old, new):
        return {new if k == old else k: v for k, v in sd.items()}

    def optim(optim_sd, old, new):
        groups = [{**g, "params": [new if n == old else n for n in g["params"]]}
                  for g in optim_sd.get("param_groups", [])]
        return {**optim_sd, "state": names(optim_sd["state"], old, new), "param_groups": groups}

    def transform(model_sd, optim_sd):
        if rename:
            return names(model_sd, alias, canon), optim(optim_sd, alias, canon)
        return {k: v for k, v in model_sd.items() if k != alias}, optim_sd

    def untransform(model_sd, optim_sd):
        if rename:
            return names(model_sd, canon, alias), optim(optim_sd, canon, alias)
        if tied.last:  # one rank holds both modules: the head reads the same tensor
            model_sd = {**model_sd, alias: model_sd[canon]}
        return model_sd, optim_sd

    return transform, untransform


# ------------------------------------------------------------------ expert slices
def _experts(model, meshes):
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
    from torch.distributed.tensor import DTensor
    params, wrap = _expert_wrapper(model, meshes)

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


def _expert_wrapper(model, meshes):
    """({state name: local expert parameter}, wrap(name, local tensor) -> the DTensor of the
    full [E, ...] tensor it is this rank's block of); ZeRO-1/2 pieces (ShardedTensors, already
    in full-tensor coordinates) pass through."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    plan = meshes.plan
    mesh = meshes.expert["edp", "ep", "etp"]
    params = {f"{lname}.experts.{pname}": p for lname, layer in moe_layers(model)
              for pname, p in layer.experts.named_parameters()}
    ep_edp = _ep_major_mesh(meshes) if any(isinstance(p, DTensor) for p in params.values()) else None

    def wrap(name, t):
        if isinstance(t, ShardedTensor) or not isinstance(t, torch.Tensor) or t.dim() == 0:
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

    return params, wrap


def _ep_major_mesh(meshes):
    """This stage's ranks as an (ep, etp, edp) DeviceMesh, without creating process groups."""
    from torch.distributed.device_mesh import DeviceMesh
    plan = meshes.plan
    grid = torch.arange(plan.world).reshape(plan.pp, plan.edp, plan.ep, plan.etp)[meshes.pp_rank]
    return DeviceMesh(meshes.expert.device_type, grid.permute(1, 2, 0).contiguous(),
                      mesh_dim_names=("ep", "etp", "edp"), _init_backend=False)


# ------------------------------------------------------------------ PipeDream-2BW
def _twobw(runner):
    """(transform, untransform) adding the gradient not yet applied to the model state as
    PENDING + name entries (a checkpoint is saved after drain(): at most one), with a flag
    PENDING + FLAG saying whether there is one (none before the first step). Loading a
    checkpoint without them (another schedule's) restores no gradient."""
    def fwd(model_sd, optim_sd):
        grads = runner.pending_state()
        out = dict(model_sd)
        for k, p in runner.params.items():
            out[PENDING + k] = grads.get(k, torch.zeros_like(p.data)).detach()
        out[PENDING + FLAG] = torch.tensor([1.0 if grads else 0.0])
        return out, optim_sd

    def back(model_sd, optim_sd):
        out = dict(model_sd)
        flag = out.pop(PENDING + FLAG, None)
        grads = {k[len(PENDING):]: out.pop(k) for k in list(out) if k.startswith(PENDING)}
        runner.set_pending(grads if flag is not None and float(flag[0]) > 0 else {})
        return out, optim_sd
    return fwd, back


# ------------------------------------------------------------------ ZeRO optimizer state
def _param_name(name: str) -> str:
    return name.replace("_orig_mod.", "")  # as get_state_dict names a compiled module's params


def _param_groups(model, optimizer, zero) -> list:
    """The optimizer's groups with each slice/master named as its model parameter."""
    names = {id(p): _param_name(n) for n, p in model.named_parameters()}
    of = zero.model_param_of()
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [names[id(of[id(s)])] for s in g["params"]]} for g in optimizer.param_groups]


def _zero_optim_pieces(model, optimizer, zero, blocks: dict) -> dict:
    """ZeRO-1/2: the slice optimizer's state as get_state_dict would name it for an unsharded
    optimizer over the model, each slice-shaped tensor as this rank's pieces of the
    parameter-shaped one (zero_shards.py; dropped where the slice is all padding), scalars
    such as Adam's step as they are. No communication."""
    names = {id(p): _param_name(n) for n, p in model.named_parameters()}
    state = {}
    for p, master, start, _ in zero.pieces():
        st = optimizer.state.get(master)
        if not st or id(p) not in names:
            continue
        out = {}
        for key in sorted(st):
            v = st[key]
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == master.shape:
                pieces = _pieces_of(v, p, start, blocks)
                if pieces is not None:
                    out[key] = pieces
            else:
                out[key] = v
        state[names[id(p)]] = out
    return {"state": state, "param_groups": _param_groups(model, optimizer, zero)}


def _set_zero_optim_pieces(model, optimizer, zero, optim_sd) -> None:
    """The pieces were loaded in place; put back the values a load replaces (non-tensors) and
    the groups' hyperparameters."""
    names = {id(p): _param_name(n) for n, p in model.named_parameters()}
    for p, master, _, _ in zero.pieces():
        st = optimizer.state.get(master)
        loaded = optim_sd["state"].get(names.get(id(p))) if st else None
        for key, v in (loaded or {}).items():
            if isinstance(v, ShardedTensor):
                continue
            if isinstance(st.get(key), torch.Tensor) and isinstance(v, torch.Tensor):
                st[key].copy_(v)
            else:
                st[key] = v
    for g, saved in zip(optimizer.param_groups, optim_sd["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})


def _zero_optim_state(model, optimizer, zero) -> dict:
    """ZeRO-3 offload's host masters: their state (shaped like the FSDP2 shards) named as
    get_state_dict would, DTensors like their parameters. No communication."""
    full = zero.full_optimizer_state(optimizer)
    state = {}
    for name, p in model.named_parameters():
        if id(p) not in full:
            continue
        state[_param_name(name)] = {k: v if not isinstance(v, torch.Tensor) or v.dim() == 0
                                    else like_param(v, p) for k, v in full[id(p)].items()}
    return {"state": state, "param_groups": _param_groups(model, optimizer, zero)}


def _set_zero_optim_state(model, optimizer, zero, optim_sd) -> None:
    """A loaded name-keyed optimizer state into ZeRO-3 offload's host masters' state."""
    from torch.distributed.tensor import DTensor
    full = {}
    for name, p in model.named_parameters():
        st = optim_sd["state"].get(_param_name(name))
        if st is not None:
            full[id(p)] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in st.items()}
    zero.load_full_optimizer_state(optimizer, full)
    for g, saved in zip(optimizer.param_groups, optim_sd["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})
