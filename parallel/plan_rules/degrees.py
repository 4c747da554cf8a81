"""The degrees and the choice fields: each value's type and range, the pipeline schedule's
stage counts, and dp resolved from the world size (dp=-1: the ranks left after tp*pp*cp),
with a fitting tp/pp/cp named when the world size does not divide."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from ..pipeline.layers import parse as parse_layers
from ..pipeline.schedules import MULTI_STAGE_SCHEDULES, PP_SCHEDULES, V_SCHEDULES
from . import _err
from .choices import CP_MODES, FP8_RECIPES, PRECISIONS, RECOMPUTE, TP_MODES


def _check_choices(p: ParallelPlan) -> None:
    for name, value, choices in (("pp_schedule", p.pp_schedule, PP_SCHEDULES),
                                 ("precision", p.precision, PRECISIONS),
                                 ("tp_mode", p.tp_mode, TP_MODES),
                                 ("recompute", p.recompute, RECOMPUTE),
                                 ("cp_mode", p.cp_mode, CP_MODES)):
        if value not in choices:
            raise _err(f"parallel.{name}={value!r} is not supported; use one of {', '.join(choices)}")
    if p.zero not in (0, 1, 2, 3) or isinstance(p.zero, bool):
        raise _err(f"parallel.zero={p.zero!r} must be 0, 1, 2 or 3")
    if not isinstance(p.compile, bool):
        raise _err(f"parallel.compile={p.compile!r} must be true, false or auto")
    if p.fp8_recipe not in FP8_RECIPES:
        raise _err(f"parallel.fp8_recipe={p.fp8_recipe!r} is not supported; use one of "
                   f"{', '.join(FP8_RECIPES)}")
    if p.fp8_recipe == "rowwise" and p.precision == "fp8" and (_gt1(p.tp) or _gt1(p.etp)):
        raise _err(f"parallel.fp8_recipe=rowwise scales each row of an expert bank's input over its "
                   f"whole width, which parallel.tp={p.tp} / parallel.etp={p.etp} split across "
                   f"ranks; set fp8_recipe=tensorwise (the banks' 128x128 blocks tile each slice) "
                   f"or tp=1 and etp=1")
    if p.fp8_recipe != "tensorwise" and p.precision != "fp8":
        raise _err(f"parallel.fp8_recipe={p.fp8_recipe} needs parallel.precision=fp8 (got "
                   f"{p.precision}); set precision=fp8 or drop fp8_recipe")
    if p.precision == "fp16" and isinstance(p.pp, int) and p.pp > 1:
        raise _err(f"parallel.precision='fp16' is not supported with parallel.pp={p.pp} (the loss "
                   f"scale would have to reach every stage's aux losses); use precision='bf16', "
                   f"which needs no loss scaling")


def _check_degrees(p: ParallelPlan) -> None:
    for name in ("tp", "pp", "cp", "ep", "etp"):
        v = getattr(p, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _err(f"parallel.{name}={v!r} must be an integer >= 1")
    mb = p.microbatches
    if not isinstance(mb, int) or isinstance(mb, bool) or mb < 0:
        raise _err(f"parallel.microbatches={mb!r} must be 0 (auto: one per pipeline stage) or an "
                   f"integer >= 1")
    if not isinstance(p.dp, int) or isinstance(p.dp, bool) or not (p.dp == -1 or p.dp >= 1):
        raise _err(f"parallel.dp={p.dp!r} must be -1 (all remaining ranks) or an integer >= 1")
    if not isinstance(p.pp_stages_per_rank, int) or p.pp_stages_per_rank < 0:
        raise _err(f"parallel.pp_stages_per_rank={p.pp_stages_per_rank!r} must be 0 (auto) or >= 1")
    parse_layers(p.pp_layers)  # its form; counts are checked against the model below
    if p.pp == 1 and str(p.pp_layers).strip() not in ("", "even"):
        raise _err(f"parallel.pp_layers={p.pp_layers!r} needs parallel.pp > 1; remove it")
    if p.pp == 1 and p.pp_stages_per_rank > 1:
        raise _err(f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} needs parallel.pp > 1; "
                   f"set pp_stages_per_rank=0")
    if p.pp_schedule in V_SCHEDULES and p.pp_stages_per_rank not in (0, 2):
        raise _err(f"parallel.pp_schedule={p.pp_schedule} places exactly 2 stages per rank (a V: "
                   f"stages r and 2*pp-1-r); set parallel.pp_stages_per_rank=0 or 2")
    if p.pp_schedule not in MULTI_STAGE_SCHEDULES and p.pp_stages_per_rank > 1:
        raise _err(f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} needs a multi-stage schedule, "
                   f"parallel.pp_schedule=interleaved_1f1b or zb_interleaved (gpipe/1f1b run one "
                   f"stage per rank)")


def _resolve_dp(p: ParallelPlan, world_size: int) -> int:
    if not isinstance(world_size, int) or world_size < 1:
        raise _err(f"world_size={world_size!r} must be a positive integer")
    rest = p.tp * p.pp * p.cp
    names = "tp*pp" + ("*cp" if p.cp > 1 else "")
    degrees = f"{p.tp}*{p.pp}" + (f"*{p.cp}" if p.cp > 1 else "")
    if p.dp == -1:
        if world_size % rest:
            raise _err(f"parallel.{names} = {degrees} = {rest} does not divide the world size "
                       f"{world_size}; start a multiple of {rest} processes, or choose {names.replace('*', ', ')} "
                       f"whose product divides {world_size} ({_fitting(p, world_size)})")
        return world_size // rest
    if p.dp * rest != world_size:
        start = f"start {p.dp * rest} processes (torchrun --nproc-per-node {p.dp * rest})"
        if world_size % rest:  # dp=-1 alone would fail next: name the whole fix at once
            fix = (f"set parallel.dp=-1 together with {_fitting(p, world_size)} (dp=-1 alone is not "
                   f"enough: {names} = {rest} does not divide {world_size})")
        else:
            fix = f"set parallel.dp=-1 (= {world_size // rest} here, the ranks left after {names})"
        raise _err(f"parallel.dp*{names} = {p.dp}*{degrees} = {p.dp * rest} but the world size is "
                   f"{world_size}; {start}, or {fix}")
    return p.dp


def _fitting(p: ParallelPlan, world_size: int) -> str:
    """The largest tp, pp (and cp) not above the plan's whose product divides the world size
    (pp and cp are lowered first: tensor parallelism is kept where it fits)."""
    fits = [(t, q, c) for t in range(1, p.tp + 1) for q in range(1, p.pp + 1)
            for c in range(1, p.cp + 1) if world_size % (t * q * c) == 0] or [(1, 1, 1)]
    t, q, c = max(fits, key=lambda f: (f[0] * f[1] * f[2], f[0], f[2]))
    return f"parallel.tp={t} parallel.pp={q}" + (f" parallel.cp={c}" if p.cp > 1 else "")


def _gt1(degree) -> bool:
    return isinstance(degree, int) and not isinstance(degree, bool) and degree > 1
