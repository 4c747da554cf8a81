"""Built-in family adapters for moe.moefy (see base.py for what an adapter is).

To add a family: write moe/adapters/<family>.py defining ADAPTER (an object with `family`,
`model_types`, `sites`, `spec`, `dense_weights`, `install`), and add it to BUILTIN below; or
pass it directly: moefy(model, ..., adapter=MyAdapter()).
"""
from . import bert, gpt2, llama, mistral, qwen2, t5

BUILTIN = tuple(m.ADAPTER for m in (gpt2, llama, mistral, qwen2, bert, t5))


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
        f"of these, pass family='<name>'; otherwise write an adapter (moe/adapters/gpt2.py is "
        f"a ~40-line example: sites, spec, dense_weights, install) and pass adapter=... or "
        f"list it in moe/adapters/__init__.py.")
