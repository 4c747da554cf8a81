"""moefy: swap the dense FFNs of a Hugging Face model for MoE layers, in place (+ reload).

Shapes: D model dim, F ffn dim, E experts.
What gets replaced in each family is documented in moe/hf/adapters/<family>.py. The swapped-in
module keeps the replaced module's forward signature and output type, so the model's own
forward, loss, generate() and save_pretrained() keep working.

Save / reload route: `model.save_pretrained(dir)` works unchanged (moefy records its
arguments as `config.moekit` in config.json); reload with `load_moefied(dir)`, which builds
the dense model from the config, moefies it the same way and loads the saved state dict.
Plain `from_pretrained` would build the dense model and cannot load MoE weights; for that,
`save_hf(model, dir)` (moe/hf/export.py) writes a converted MoE model back in its own
architecture, and an upcycled Llama/Mistral/Qwen2 as Mixtral/Qwen2-MoE where they match.
"""
import json
import os

import torch

from ..quiet import transformers_quietly
from .adapters import adapter_for
from ..aux import inject_aux_loss, moe_layers
from .convert import convert_moe_blocks, explicit_args, is_moe_adapter
from .export import CONFIG_KEY
from ..layer import MoELayer
from .upcycle import upcycle_layer

_NOT_KWARGS = {"d_model": "it comes from the model", "ep_group": (
    "apply expert parallelism after moefy with the parallel/ functions")}
_SHAPE_KWARGS = ("d_ff", "activation", "expert_bias")  # copied from the dense FFN when upcycling


def _check_args(num_experts, top_k, every, upcycle, moe_kwargs) -> None:
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every={every!r} must be an integer >= 1 (1: every FFN, 2: every other)")
    for name, why in _NOT_KWARGS.items():
        if name in moe_kwargs:
            raise ValueError(f"moefy got {name}=...: not allowed, {why}")
    if upcycle:
        for name in _SHAPE_KWARGS:
            if name in moe_kwargs:
                raise ValueError(f"moefy got {name}=... with upcycle=True: upcycled experts copy "
                                 f"the dense FFN's {name}; drop it or pass upcycle=False")
    try:
        json.dumps(moe_kwargs)
    except TypeError as e:
        raise ValueError(f"moefy's extra MoELayer arguments must be plain values (they are "
                         f"saved in config.json): {e}") from None
    # num_experts / top_k / capacity_factor are validated by MoELayer with named errors
    del num_experts, top_k


def _selected(sites: list, every: int) -> list:
    """FFN i of each stack is swapped iff (i + 1) % every == 0."""
    seen, chosen = {}, []
    for site in sites:
        i = seen.get(site.stack, 0)
        seen[site.stack] = i + 1
        if (i + 1) % every == 0:
            chosen.append(site)
    return chosen


def moefy(model, num_experts=None, top_k=None, every: int = 1, capacity_factor=None,
          upcycle=None, *, family=None, adapter=None, router_init_std: float = 1e-3,
          inject_aux: bool = False, **moe_kwargs):
    """Replace, in place, every `every`-th dense FFN of `model` with a moe.MoELayer; or, for a
    transformers MoE model (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss,
    ernie4_5_moe, switch_transformers), convert each sparse block into a MoELayer with the
    same weights and routing, read from the model's config.

    family: force a built-in adapter (default: from model.config.model_type); adapter: your
    own (see moe/hf/adapters/base.py, moe/hf/adapters/hf_moe.py). Dense models need num_experts and
    top_k. upcycle (dense models, default True): experts start as copies of the dense FFN and
    the router small (see moe/hf/upcycle.py); else MoELayer's own init. inject_aux: aux losses
    reach backward without changing the training code (moe/aux.py). Other keyword arguments
    go to MoELayer (aux_loss_coef, z_loss_coef, router, jitter, num_shared_experts, ...);
    for an MoE model, one that contradicts its config is an error. Returns the model.
    """
    adapter = adapter or adapter_for(model, family)
    if is_moe_adapter(adapter):
        return _convert(model, adapter, num_experts, top_k, every, capacity_factor, upcycle,
                        inject_aux, moe_kwargs)
    if num_experts is None or top_k is None:
        raise ValueError(f"moefy on a dense {adapter.family} model needs num_experts and top_k "
                         f"(e.g. moefy(model, num_experts=8, top_k=2))")
    upcycle = True if upcycle is None else upcycle
    _check_args(num_experts, top_k, every, upcycle, moe_kwargs)
    sites = adapter.sites(model)
    if not sites:
        done = " (it already has MoE layers: moefy it only once)" if moe_layers(model) else ""
        raise ValueError(f"the {adapter.family} adapter found no dense FFN in "
                         f"{type(model).__name__}{done}")
    config = getattr(model, "config", None)
    for site in _selected(sites, every):
        spec = adapter.spec(site, config)
        dense = adapter.dense_weights(site)
        kwargs = {"activation": spec.activation, "expert_bias": spec.bias, "d_ff": spec.d_ff,
                  **moe_kwargs}
        moe = MoELayer(d_model=spec.d_model, num_experts=num_experts, top_k=top_k,
                       capacity_factor=capacity_factor, **kwargs)
        moe.to(device=dense.w1_DF.device, dtype=dense.w1_DF.dtype)
        if upcycle:
            upcycle_layer(moe, dense, router_init_std)
        adapter.install(site, moe, spec)
        site.owner.train(site.owner.training)  # new modules follow the model's train/eval mode
    if config is not None:
        setattr(config, CONFIG_KEY, {
            "format": 1, "family": adapter.family, "num_experts": num_experts, "top_k": top_k,
            "every": every, "capacity_factor": capacity_factor, "inject_aux": inject_aux,
            "moe_kwargs": dict(moe_kwargs)})
    if inject_aux:
        inject_aux_loss(model)
    return model


def _convert(model, adapter, num_experts, top_k, every, capacity_factor, upcycle, inject_aux,
             moe_kwargs):
    if every != 1:
        raise ValueError(f"moefy got every={every} for a {adapter.family} model: which blocks are "
                         f"sparse comes from its config; drop the argument")
    if upcycle:
        raise ValueError(f"moefy got upcycle=True for a {adapter.family} model, which already has "
                         f"trained experts; drop the argument")
    _check_args(num_experts or 1, top_k or 1, every, False, moe_kwargs)
    convert_moe_blocks(model, adapter, explicit_args(num_experts, top_k, capacity_factor, moe_kwargs))
    # transformers' own router-logit recording has nothing left to record: the aux losses
    # now come from the MoELayers (moe.aux); save_hf restores the setting
    router_logits = getattr(model.config, "output_router_logits", None)
    if router_logits is not None:
        model.config.output_router_logits = False
    setattr(model.config, CONFIG_KEY, {
        "format": 1, "family": adapter.family, "converted": True, "inject_aux": inject_aux,
        "output_router_logits": router_logits, "moe_kwargs": dict(moe_kwargs)})
    if inject_aux:
        inject_aux_loss(model)
    return model


def _read_state_dict(path: str) -> dict:
    from safetensors.torch import load_file
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(single):
        return load_file(single)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for name in files:
            state.update(load_file(os.path.join(path, name)))
        return state
    legacy = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path} holds no model.safetensors[.index.json] or "
                            f"pytorch_model.bin; save with model.save_pretrained({path!r})")


def _undo_renames(state: dict, wanted: set) -> dict:
    """Undo module renames transformers' save_pretrained applies for some families (e.g.
    Mixtral's `mlp` is written as `block_sparse_moe`): a saved key the model lacks is mapped
    to the one key the model expects that differs from it in exactly one path component."""
    unknown = [k for k in state if k not in wanted]
    if not unknown:
        return state
    open_keys = wanted - set(state)
    by_shape = {}
    for k in open_keys:
        parts = k.split(".")
        for i in range(len(parts)):
            by_shape.setdefault((i, tuple(parts[:i]), tuple(parts[i + 1:])), []).append(k)
    out = dict(state)
    for k in unknown:
        parts = k.split(".")
        hits = {m for i in range(len(parts))
                for m in by_shape.get((i, tuple(parts[:i]), tuple(parts[i + 1:])), [])}
        if len(hits) == 1:
            out[hits.pop()] = out.pop(k)
    return out


def _tied_keys(model) -> set:
    tied = getattr(model, "_tied_weights_keys", None) or ()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def load_moefied(path: str, adapter=None):
    """Rebuild a model saved with save_pretrained after moefy, with its trained weights."""
    transformers = transformers_quietly()
    config = transformers.AutoConfig.from_pretrained(path)
    section = getattr(config, CONFIG_KEY, None)
    if not isinstance(section, dict):
        raise ValueError(f"{path}/config.json has no '{CONFIG_KEY}' section: it was not saved "
                         f"from a moefied model; load it with from_pretrained instead")
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch or "", None)
    if cls is None:
        raise ValueError(f"{path}/config.json names architectures={arch!r}, which transformers "
                         f"does not export; save with model.save_pretrained")
    model = cls(config)   # fresh init, overwritten by the saved weights below
    if section.get("converted"):
        moefy(model, family=section["family"], adapter=adapter, inject_aux=section["inject_aux"],
              **section["moe_kwargs"])
    else:
        moefy(model, section["num_experts"], section["top_k"], section["every"],
              section["capacity_factor"], upcycle=False, family=section["family"],
              adapter=adapter, inject_aux=section["inject_aux"], **section["moe_kwargs"])
    state = _read_state_dict(path)
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    state = _undo_renames(state, set(model.state_dict()))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:
        raise ValueError(f"{path}: saved weights do not fit the rebuilt model: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()
