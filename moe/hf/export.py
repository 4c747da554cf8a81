"""save_hf: write a moefied model as a checkpoint plain transformers loads (from_pretrained).

Shapes: E experts, D model dim, F expert ffn dim.
Two cases:
  * a converted transformers MoE model (moefy on mixtral, qwen2_moe, ...): each MoELayer is
    written back in its family's own layout (the adapter's `export`), config unchanged.
  * a dense model upcycled by moefy: exported to the MoE architecture computing the same
    function, if there is one: Llama/Mistral -> Mixtral (swiglu, softmax top-k with the k
    gates renormalised, no shared expert, dropless, every FFN an MoE), Qwen2 -> Qwen2-MoE
    (any `every`, norm_topk_prob either way; an existing shared expert needs
    shared_expert_gate=True; without one, Qwen2-MoE's always-present shared expert is
    written with zero weights, which adds exactly 0). Anything else raises and points to
    save_pretrained + moe.hf.load_moefied, which round-trips every moefied model.
"""
import copy
import os

from .adapters import adapter_for
from .adapters.hf_moe import export_gated_mlp, export_stacked
from .convert import wrapped_layers
from .upcycled_export import FALLBACK, target_for

CONFIG_KEY = "moekit"   # the section moefy adds to model.config


def _state_with(model, replace: dict) -> dict:
    """model.state_dict() with each `prefix.moe.*` swapped for `prefix.<exported name>`."""
    state = {k: v for k, v in model.state_dict().items()
             if not any(k.startswith(p + ".moe.") for p in replace)}
    for prefix, tensors in replace.items():
        state.update({f"{prefix}.{k}": v for k, v in tensors.items()})
    seen, out = set(), {}
    for k, v in state.items():  # safetensors refuses tensors sharing storage (tied weights)
        v = v.detach().contiguous()
        if v.data_ptr() in seen:
            v = v.clone()
        seen.add(v.data_ptr())
        out[k] = v
    return out


def _write(config, state: dict, path: str) -> None:
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _clean_config(config):
    config = copy.deepcopy(config)
    section = getattr(config, CONFIG_KEY, {})
    if section.get("output_router_logits") is not None:
        config.output_router_logits = section["output_router_logits"]
    if hasattr(config, CONFIG_KEY):
        delattr(config, CONFIG_KEY)
    return config


def save_hf(model, path: str) -> None:
    """Write `model` (moefied) to `path` as a plain transformers checkpoint; see the module doc."""
    section = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if not isinstance(section, dict):
        raise ValueError("save_hf needs a model moefied by moe.moefy (its config has no "
                         f"'{CONFIG_KEY}' section); a plain model saves with save_pretrained")
    if section.get("converted"):
        adapter = adapter_for(model, section["family"])
        replace = {}
        for prefix, moe in wrapped_layers(model):
            if adapter.selection_bias is None and moe.router.selection_bias.any():
                raise ValueError(f"{prefix}: the selection bias moved (update_selection_bias), and "
                                 f"{adapter.family} checkpoints have no place for it; {FALLBACK}")
            replace[prefix] = adapter.export(moe)
        _write(_clean_config(model.config), _state_with(model, replace), path)
        return
    target = target_for(model, section)
    replace = {prefix: _export_upcycled(moe, target.shared) for prefix, moe in wrapped_layers(model)}
    _write(target.config, _state_with(model, replace), path)


def _export_upcycled(moe, shared: str) -> dict:
    out = {"gate.weight": moe.router.weight.detach(), **export_stacked(moe.experts)}
    if shared == "gated":
        out.update(export_gated_mlp(moe.shared_experts.bank, "shared_expert"))
        out["shared_expert_gate.weight"] = moe.shared_experts.gate.detach()
    elif shared == "zero":
        D, w = moe.d_model, moe.router.weight
        out["shared_expert.gate_proj.weight"] = w.new_zeros(1, D)
        out["shared_expert.up_proj.weight"] = w.new_zeros(1, D)
        out["shared_expert.down_proj.weight"] = w.new_zeros(D, 1)
        out["shared_expert_gate.weight"] = w.new_zeros(1, D)
    return out


