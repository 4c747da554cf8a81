"""Activation recomputation (parallel/recompute.py): recompute_modules parsed into its parts,
the parts that clash with tp or cp, and the parts the model does not have."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from ..recompute_parts import RECOMPUTE_PARTS
from . import _err
from .choices import RECOMPUTE_MODULES
from .experts import _has_dense_ffn, _has_moe


def _recompute_parts(p: ParallelPlan) -> list:
    v = p.recompute_modules
    names = v if isinstance(v, (list, tuple)) else str(v).split(",")
    out = []
    for n in names:
        n = str(n).strip()
        if n and n not in RECOMPUTE_MODULES:
            raise _err(f"parallel.recompute_modules names {n!r}; use any of {', '.join(RECOMPUTE_MODULES)}")
        if n and n not in out:
            out.append(n)
    return out


def _check_recompute(p: ParallelPlan) -> None:
    parts = p.recompute_parts
    if p.recompute == "selective" and not parts:
        raise _err("parallel.recompute=selective needs parallel.recompute_modules, e.g. "
                   "parallel.recompute_modules=layernorm,moe_act")
    if p.recompute != "selective" and parts:
        raise _err(f"parallel.recompute_modules={p.recompute_modules} is read by "
                   f"parallel.recompute=selective only (got recompute={p.recompute}); set "
                   f"recompute=selective or recompute_modules=''")
    if "layernorm" in parts and p.tp > 1 and p.tp_mode != "1d":
        raise _err(f"parallel.recompute_modules=layernorm with parallel.tp_mode={p.tp_mode}: the "
                   f"grid's gathered norm outputs are kept by the layers reading them, so nothing "
                   f"would be freed; drop layernorm or set tp_mode=1d")
    if "core_attn" in parts and p.cp > 1:
        raise _err(f"parallel.recompute_modules=core_attn with parallel.cp={p.cp}: the context-"
                   f"parallel attention core exchanges keys and values, which recomputing would "
                   f"repeat; drop core_attn or set cp=1")


def _check_recompute_model(p: ParallelPlan, m, moe_cfg) -> None:
    """A part the model does not have would be a setting that does nothing: refused."""
    moe, dense = _has_moe(moe_cfg), _has_dense_ffn(moe_cfg)
    # whether the model has each of RECOMPUTE_PARTS' `needs` (a new kind of need: a KeyError here)
    has = {"": True, "model.attention='mla'": getattr(m, "attention", "mha") == "mla",
           "a block without MoE": dense, "MoE blocks": moe,
           "moe.num_shared_experts > 0": moe and bool(getattr(moe_cfg, "num_shared_experts", 0))}
    for part in p.recompute_parts:
        what = RECOMPUTE_PARTS[part].needs
        if not has[what]:
            raise _err(f"parallel.recompute_modules={part}: the model has no {part} (needs {what}); "
                       f"drop it from parallel.recompute_modules")
