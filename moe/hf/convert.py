"""Convert a Hugging Face MoE model's sparse blocks into moekit MoELayers, in place.

Every routing setting comes from the model's config (see moe/hf/adapters/<family>.py); an
explicit argument may repeat a setting but not contradict it. Blocks are converted one at
a time and each HF block is dropped as soon as its MoELayer is installed, so at most one
layer's expert weights exist twice during the conversion.
"""
import inspect

from ..layer import MoELayer

# MoELayer arguments that change what the layer computes: an explicit value must match the
# family's (or MoELayer's default, where the family sets nothing).
ROUTING_ARGS = ("num_experts", "top_k", "capacity_factor", "eval_capacity_factor", "d_ff",
                "activation", "router", "score_func", "norm_topk_prob", "n_group",
                "topk_group", "routed_scaling_factor", "router_bias", "num_shared_experts",
                "shared_d_ff", "shared_expert_gate", "expert_bias", "swiglu_alpha",
                "swiglu_limit", "logits_dtype", "score_dtype", "expert_capacity", "jitter")
_LAYER_DEFAULTS = {name: p.default for name, p in
                   inspect.signature(MoELayer.__init__).parameters.items()
                   if p.default is not inspect.Parameter.empty}


def check_explicit(family: str, derived: dict, explicit: dict) -> None:
    """Raise if an explicit routing argument contradicts what the checkpoint's config says."""
    for name, value in explicit.items():
        if name not in ROUTING_ARGS:
            continue
        want = derived.get(name, _LAYER_DEFAULTS.get(name))
        if value != want:
            raise ValueError(f"moefy got {name}={value!r}, but this {family} model's config "
                             f"implies {name}={want!r}; drop the argument (converted layers "
                             f"keep the checkpoint's routing) or change model.config")


def convert_moe_blocks(model, adapter, explicit: dict) -> list:
    """Swap each sparse block found by `adapter` for a MoELayer with its weights; returns
    the MoELayers' qualified names."""
    sites = adapter.sites(model)
    if not sites:
        raise ValueError(f"the {adapter.family} adapter found no sparse MoE block in "
                         f"{type(model).__name__} (already converted? moefy it only once)")
    names = []
    for site in sites:
        block = site.owner.mlp
        derived = adapter.layer_kwargs(model.config, block)
        check_explicit(adapter.family, derived, explicit)
        # the experts' dtype: Switch's router may already have cast itself to fp32
        first = next(p for n, p in block.named_parameters() if n.startswith("experts"))
        moe = MoELayer(**{**derived, **explicit}).to(device=first.device, dtype=first.dtype)
        adapter.load(block, moe)
        adapter.install(site, moe)   # the owner's reference was the block's last one
        del block, first
        site.owner.train(site.owner.training)
        names.append(f"{site.name}.mlp" if site.name else "mlp")
    return names


def explicit_args(num_experts, top_k, capacity_factor, moe_kwargs: dict) -> dict:
    out = dict(moe_kwargs)
    for name, value in (("num_experts", num_experts), ("top_k", top_k),
                        ("capacity_factor", capacity_factor)):
        if value is not None:
            out[name] = value
    return out


def is_moe_adapter(adapter) -> bool:
    return getattr(adapter, "kind", "dense") == "moe"


def wrapped_layers(model) -> list:
    """[(prefix of the swapped-in module, MoELayer)]: the modules whose `.moe` is the layer
    (what moefy installed, converted or upcycled)."""
    out = []
    for name, module in model.named_modules():
        moe = getattr(module, "moe", None)
        if isinstance(moe, MoELayer):
            out.append((name, moe))
    return out
