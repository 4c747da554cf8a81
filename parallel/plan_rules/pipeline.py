"""Pipeline parallelism (parallel/pipeline/): what PipeDream-2BW's schedule does not serve, and
parallel.pp_layers resolved to one block count per stage."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from ..pipeline.layers import resolve as resolve_layers
from . import _err
from .experts import _has_moe


def _check_2bw(p: ParallelPlan) -> None:
    """PipeDream-2BW runs its own schedule (parallel/pipeline/twobw.py) over one stage per rank and
    applies the optimizer to whole, untied, fp32 stage weights; what it does not serve is refused."""
    if p.pp_schedule != "2bw" or p.pp == 1:
        return
    fix = "or use parallel.pp_schedule=1f1b"
    for bad, what in ((p.microbatches < p.pp, f"parallel.microbatches={p.microbatches} < parallel.pp="
                       f"{p.pp}: a step's gradient is complete only m >= pp micro-batches later; raise "
                       f"microbatches to {p.pp} or more"),
                      (p.tp > 1, f"parallel.tp={p.tp}: set tp=1"),
                      (p.ep > 1 or p.etp > 1, "parallel.ep/etp > 1: set ep=1 and etp=1"),
                      (p.zero > 0, f"parallel.zero={p.zero}: the stashed weight versions are whole "
                       f"parameters; set zero=0"),
                      (p.stages_per_rank > 1, "parallel.pp_stages_per_rank > 1: 2bw runs one stage per "
                       "rank; set pp_stages_per_rank=0"),
                      (p.recompute != "none", f"parallel.recompute={p.recompute}: set recompute=none"),
                      (p.precision != "fp32", f"parallel.precision={p.precision}: set precision=fp32"),
                      (p.compile, "parallel.compile=true: set compile=false")):
        if bad:
            raise _err(f"parallel.pp_schedule=2bw with {what} ({fix})")


def _stage_layers(p: ParallelPlan, m, moe_cfg, seq_len) -> str:
    """parallel.pp_layers resolved to its explicit form (pipeline/layers.py)."""
    try:
        return resolve_layers(p.pp_layers, p.num_stages, m, moe_cfg if _has_moe(moe_cfg) else None,
                              seq_len)
    except ValueError as e:
        raise _err(f"{e} (parallel.pp={p.pp} x {p.stages_per_rank} stage(s) per rank)") from None
