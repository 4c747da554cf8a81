"""The one answer to "what kind of parameter is this", for every layout.

  dense   everything outside MoE layers (reduced over dp); a MoE layer's shared experts split
          over the 2-D grid count as dense too (each grid rank holds a different block)
  pool    a MoE layer's router and shared experts (reduced over the dp x tp token pool)
  expert  a MoE layer's expert bank, MoELayer.experts (reduced over the expert-data-parallel
          copies; sharded by expert parallelism; per-expert units for the parameter server)
Gradient sync (data_parallel/data_parallel/grad_sync.py), ZeRO, the norm (grads.py), the parameter server
(data_parallel/data_parallel/param_server/units.py) and the planner (planner/flops.py) all ask here.
"""
import torch
from torch.distributed.tensor import DTensor

from moe import MoELayer
from moe.ep_dispatcher import EXPERT_PARAM_ATTR

KINDS = ("dense", "pool", "expert")


def param_kinds(model: torch.nn.Module) -> dict:
    """Map each parameter (by id) to 'dense', 'pool' or 'expert'. A MoE layer's shared
    experts split over the 2-D grid (parallel/tensor/grid.py) are dense: their tp sums are the
    grid's own, each rank holds a different block."""
    kinds = {}
    for mod in model.modules():
        if isinstance(mod, MoELayer):
            for p in mod.parameters():
                kinds[id(p)] = "dense" if _on_grid(p) else "pool"
            for p in mod.experts.parameters():
                kinds[id(p)] = "expert"
    return {id(p): kinds.get(id(p), "dense") for p in model.parameters()}


def _on_grid(p) -> bool:
    return isinstance(p, DTensor) and "tpc" in (p.device_mesh.mesh_dim_names or ())


def expert_param_names(model: torch.nn.Module) -> set:
    """Names of the [E, ...] expert tensors of every MoELayer (w1, w2, w3 and biases)."""
    out = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MoELayer):
            prefix = f"{mod_name}.experts." if mod_name else "experts."
            out.update(prefix + n for n, _ in mod.experts.named_parameters(recurse=False))
    return out


def is_expert_param(name_or_param) -> bool:
    """True for parameters of an MoE layer's expert bank (not router, not shared experts).

    A parameter is recognized by the mark set when sharding; a name by a path component
    equal to "experts" (e.g. "blocks.0.ffn.experts.w1"), which also works before sharding
    and after wrappers that replace parameter objects.
    """
    if isinstance(name_or_param, str):
        return "experts" in name_or_param.split(".")
    return bool(getattr(name_or_param, EXPERT_PARAM_ATTR, False))
