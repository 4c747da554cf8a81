"""Built-in family adapters for moe.moefy (see base.py for what an adapter is).

To add a family: write moe/hf/adapters/<family>.py defining ADAPTER (an object with `family`,
`model_types`, `sites`, `spec`, `dense_weights`, `install`; for a family that already has
MoE blocks: kind="moe", `sites`, `layer_kwargs`, `load`, `install`, `export`, see
hf_moe.py), and add it to BUILTIN below; or pass it directly: moefy(model, adapter=...).
"""
from . import (bert, deepseek_v3, ernie4_5_moe, gpt2, gpt_oss, llama, mistral, mixtral, qwen2,
               qwen_moe, switch_transformers, t5)

# dense families (moefy swaps FFNs for new MoE layers), then MoE families (moefy converts
# their sparse blocks, see moe/hf/adapters/hf_moe.py)
BUILTIN = tuple(m.ADAPTER for m in (gpt2, llama, mistral, qwen2, bert, t5)) + (
    mixtral.ADAPTER, qwen_moe.QWEN2_MOE, qwen_moe.QWEN3_MOE, qwen_moe.OLMOE, deepseek_v3.ADAPTER,
    gpt_oss.ADAPTER, ernie4_5_moe.ADAPTER, switch_transformers.ADAPTER)


def supported_families() -> list:
    return [a.family for a in BUILTIN]


def adapter_for(model, family=None):
    """The adapter named `family`, else the one whose model_types has model.config.model_type."""
    if family is not None:
        for a in BUILTIN:
            if a.family == family:
                return a
        raise ValueError(f"family={family!r} is not a built-in adapter; "
                         f"use one of {supported_families()} or pass adapter=...")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for a in BUILTIN:
        if model_type in a.model_types:
            return a
    raise ValueError(
        f"moefy does not know {type(model).__name__} (config.model_type={model_type!r}). "
        f"Supported families: {supported_families()}. If the model's FFNs are built like one "
        f"of these, pass family='<name>'; otherwise write an adapter (moe/hf/adapters/gpt2.py is "
        f"a ~40-line example: sites, spec, dense_weights, install) and pass adapter=... or "
        f"list it in moe/hf/adapters/__init__.py.")
