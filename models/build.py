"""Build on the meta device, initialise deterministically, count parameters.

init_weights gives every module its own RNG stream, seeded from (seed, the module's name in
the freshly built model) and, for expert banks, one stream per *global* expert. So the
weights do not depend on module order, on what ran before, on pipeline splits or wrappers
(the name is stamped at build time), nor on how experts are spread over expert-parallel
ranks: rank r of P initialises exactly the experts [r*E/P, (r+1)*E/P) of the one-process
model. Values are drawn on the CPU and copied to the target device, so CPU and CUDA runs
start from identical weights.

DTensor parameters (FSDP2 / tensor parallel) are handled one module at a time: the module's
full (for experts: EP-local, with their whole d_ff) parameters are drawn into temporary
tensors and each rank keeps its own shard (its d_ff block under expert tensor parallelism).
Peak extra memory is the largest single module (typically one expert bank).
"""
import hashlib

import torch
import torch.nn as nn

from moe import ExpertBank, MoELayer
from moe.aux import moe_layers
from moe.expert_tp import FFN_DIMS, ffn_block

from .config import ModelConfig, MoEConfig

INIT_NAME_ATTR = "_init_name"  # stable module name stamped by build_model


def build_model(model_cfg: ModelConfig, moe_cfg: MoEConfig, device="meta", seed: int = 0) -> nn.Module:
    """Validate the configs and build the model on `device` (default meta: no memory).

    For a real device, the model is built on meta and materialised with init_weights(seed).
    """
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a models.ModelConfig, got {type(model_cfg).__name__}")
    if moe_cfg is None:
        moe_cfg = MoEConfig(every=0)
    if not isinstance(moe_cfg, MoEConfig):
        raise TypeError(f"moe_cfg must be a models.MoEConfig or None, got {type(moe_cfg).__name__}")
    model_cfg.validate()
    moe_cfg.validate(model_cfg)
    from .gpt import GPT
    from .switch import Switch
    cls = {"gpt": GPT, "switch": Switch}[model_cfg.arch]
    with torch.device("meta"):
        model = cls(model_cfg, moe_cfg)
    for name, module in model.named_modules():
        setattr(module, INIT_NAME_ATTR, name)
    if torch.device(device).type != "meta":
        init_weights(model, seed, device)
    return model


def _stream_seed(seed: int, *key) -> int:
    digest = hashlib.sha256("/".join(map(str, (seed,) + key)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _is_dtensor(p) -> bool:
    return type(p).__name__ == "DTensor" or hasattr(p, "device_mesh")


def _expert_offset(layer: MoELayer) -> int:
    """Global index of this rank's first expert (rank r of P holds [r*E/P, (r+1)*E/P))."""
    if layer.ep_group is None:
        return 0
    import torch.distributed as dist
    return dist.get_rank(layer.ep_group) * layer.experts.num_local


def _ffn_split(layer: MoELayer):
    """(rank, n) of the expert-tensor-parallel group splitting this layer's experts' d_ff, or
    None (moe/expert_tp.py: rank j holds block j of d_ff)."""
    if layer.etp_group is None:
        return None
    import torch.distributed as dist
    return dist.get_rank(layer.etp_group), dist.get_world_size(layer.etp_group)


def _full_shape(name: str, p, split) -> tuple:
    """The shape to draw for parameter `name`: its global shape, with the whole d_ff for an
    expert parameter split by expert tensor parallelism."""
    shape = list(p.shape)
    if split is not None and name in FFN_DIMS:
        shape[FFN_DIMS[name]] *= split[1]
    return tuple(shape)


def _draw(module: nn.Module, params: dict, seed: int, key: str, expert_offset, split=None) -> dict:
    """Run module.reset_parameters on CPU temporaries shaped like `params` (global shapes;
    whole experts under expert tensor parallelism, `split`).

    Swaps the temporaries into module._parameters, so reset_parameters sees ordinary tensors.
    Expert banks are drawn one expert at a time with a per-global-expert seed.
    """
    full = {n: torch.empty(_full_shape(n, p, split), dtype=p.dtype, device="cpu")
            for n, p in params.items()}
    chunks = [(None, full)]
    if expert_offset is not None:  # ExpertBank: dim 0 is the expert
        n_local = next(iter(full.values())).shape[0]
        chunks = [(expert_offset + e, {n: t[e:e + 1] for n, t in full.items()}) for e in range(n_local)]
    try:
        for expert, tensors in chunks:
            for n, t in tensors.items():
                module._parameters[n] = nn.Parameter(t, requires_grad=False)  # shares t's storage
            torch.manual_seed(_stream_seed(seed, key) if expert is None else _stream_seed(seed, key, expert))
            module.reset_parameters()
    finally:
        for n, p in params.items():
            module._parameters[n] = p
    return full


@torch.no_grad()
def _write(p: torch.Tensor, full_cpu: torch.Tensor) -> None:
    if _is_dtensor(p):
        from torch.distributed.tensor import distribute_tensor
        full = full_cpu.to(p.to_local().device)
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full_cpu)


def init_weights(model: nn.Module, seed: int, device=None, source: dict | None = None) -> nn.Module:
    """Materialise `model` (to_empty on `device` if it is on meta) and initialise it.

    Calls each parameter-owning module's reset_parameters() with its own seeded stream (see
    the module docstring); buffers are zeroed first (all buffers of these models start at 0:
    router selection bias and load counters). Tied parameters are initialised once, by the
    first module that owns them. The global RNG state is left untouched.
    source: {single-process state-dict name: full tensor} to take every parameter (and the
    buffers it has) from instead, each rank writing its part (experts, d_ff block, DTensor
    shard) as it writes a drawn tensor (models/hf_weights.py reads checkpoints into one).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        ties = _shared_params(model)
        model.to_empty(device=device)
        _retie(model, ties)
    with torch.no_grad():
        for b in model.buffers():
            b.zero_()
        for name, b in _named_buffers(model) if source is not None else ():
            if name in source:
                _write(b, source[name].to(b.dtype))
    done = set()
    with torch.random.fork_rng(devices=[]):
        for name, module in model.named_modules():
            params = {n: p for n, p in module._parameters.items() if p is not None}
            if not params:
                continue
            if not callable(getattr(module, "reset_parameters", None)):
                raise TypeError(f"module {name!r} ({type(module).__name__}) owns parameters but has "
                                f"no reset_parameters(); init_weights cannot initialise it")
            key = getattr(module, INIT_NAME_ATTR, name)
            offset, split = None, None
            if isinstance(module, ExpertBank):
                layer = _owner_layer(model, name)
                offset, split = _expert_offset(layer), _ffn_split(layer)
            full = _draw(module, params, seed, key, offset, split) if source is None else \
                _taken(source, key, params, offset, split)
            for n, p in params.items():
                if id(p) not in done:
                    block = full[n] if split is None or n not in FFN_DIMS else ffn_block(full[n], n, *split)
                    _write(p, block)
                    done.add(id(p))
    return model


def _taken(source: dict, key: str, params: dict, offset, split) -> dict:
    """The module's tensors from `source` in _draw's form: global shapes, this rank's experts."""
    out = {}
    for n, p in params.items():
        name = f"{key}.{n}" if key else n
        if name not in source:
            raise KeyError(f"{name}: the weights given have no such tensor (a checkpoint of "
                           f"another architecture than the model's config?)")
        t = source[name]
        if offset is not None:  # an expert bank: this rank's experts
            t = t[offset:offset + p.shape[0]]
        want = _full_shape(n, p, split)  # global (a DTensor's shape is), whole d_ff under etp
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: the weights given are {tuple(t.shape)}, the model's {want}")
        out[n] = t.to(p.dtype)
    return out


def _named_buffers(model: nn.Module) -> list:
    """[(single-process name, buffer)]: each buffer under its module's stable name."""
    out = []
    for name, module in model.named_modules():
        key = getattr(module, INIT_NAME_ATTR, name)
        for n, b in module._buffers.items():
            if b is not None:
                out.append((f"{key}.{n}" if key else n, b))
    return out


def _shared_params(model: nn.Module) -> list:
    """[(owner module, name, [(other module, name), ...])] for Parameters held by several modules."""
    first, ties = {}, {}
    for module in model.modules():
        for n, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                ties.setdefault(id(p), (first[id(p)], []))[1].append((module, n))
            else:
                first[id(p)] = (module, n)
    return [(owner, n, others) for (owner, n), others in ties.values()]


def _retie(model: nn.Module, ties: list) -> None:
    # to_empty gives each module its own new Parameter, silently untying shared weights
    for owner, n, others in ties:
        for module, m in others:
            setattr(module, m, owner._parameters[n])


def _owner_layer(model: nn.Module, bank_name: str):
    """The MoELayer holding the expert bank `bank_name`, or a stand-in for a dense FFN bank."""
    parent = model.get_submodule(bank_name.rpartition(".")[0]) if "." in bank_name else model
    return parent if isinstance(parent, MoELayer) else _NoEP


class _NoEP:
    ep_group = None
    etp_group = None


def count_params(model: nn.Module) -> dict:
    """{"total", "active_per_token"} over unique parameters (tied weights once).

    Expert banks count num_experts (from the layer, not the local tensor, so the numbers are
    the same under expert parallelism) and active_per_token counts top_k of them; every other
    parameter (embeddings, attention, norms, routers, dense FFNs, shared experts) is active.
    DTensor parameters count their global size. A pipeline stage counts only its own modules.
    """
    expert_ids, total, active = set(), 0, 0
    for _, layer in moe_layers(model):
        bank = list(layer.experts.parameters())
        expert_ids.update(id(p) for p in bank)
        n_local = layer.experts.w1.shape[0]
        per_expert = sum(p.numel() for p in bank) // n_local
        total += per_expert * layer.num_experts
        active += per_expert * layer.top_k
    seen = set()
    for p in model.parameters():  # parameters() already yields a tied Parameter once
        if id(p) in expert_ids or id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        active += p.numel()
    return {"total": total, "active_per_token": active}
