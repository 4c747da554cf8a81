"""The plan against the model and the batch: sizes each degree divides (dispatching to the
tensor, context, expert and recompute model checks), precision=fp8's 128 x 128 blocks, and the
global batch against dp, the micro-batches and the schedule."""
from __future__ import annotations  # ParallelPlan (parallel/plan.py) is named in hints only

from ..pipeline.schedules import V_SCHEDULES
from . import _err
from .context import _check_cp_model
from .experts import _check_etp_model, _has_dense_ffn, _has_moe
from .recompute import _check_recompute_model
from .tensor import _check_grid_model, _check_tp_attention


def _check_mtp_layout(p: ParallelPlan, m, depth: int) -> None:
    """Multi-token prediction runs under dp, ZeRO, FSDP, 1-D tp, ep/etp and cp, and under pp
    on the last stage with tied embeddings, without tp or ZeRO-3 there
    (parallel/pipeline/mtp.py); not under the 2-D grid."""
    if depth and p.pp > 1:
        why = ("model.tie_embeddings=false (the last stage reads the embedding through the head "
               "it shares; an untied copy there is not built yet)" if not getattr(m, "tie_embeddings", True)
               else f"parallel.tp={p.tp} (the depths run outside the sharded stage)" if p.tp > 1
               else "parallel.zero=3 (the depths run outside the stage's forward, where FSDP2 "
                    "keeps its parameters sharded)" if p.zero == 3 else "")
        if why:
            raise _err(f"model.mtp_depth={depth} with parallel.pp={p.pp} and {why}; use "
                       f"pp with tied embeddings, tp=1 and zero<=2, or parallel.pp=1, or "
                       f"model.mtp_depth=0")
    if depth and p.tp > 1 and p.tp_mode != "1d":
        raise _err(f"model.mtp_depth={depth} with parallel.tp_mode={p.tp_mode}: multi-token "
                   f"prediction runs under 1-D tensor parallelism only; set parallel.tp_mode=1d")


def _check_model(p: ParallelPlan, m, moe_cfg) -> None:
    arch = getattr(m, "arch", "gpt")
    if arch != "gpt" and (p.tp > 1 or p.pp > 1):
        raise _err(f"parallel.tp/pp > 1 is implemented for model.arch='gpt' only (got {arch!r}); "
                   f"use data/expert parallelism and ZeRO for it (tp=1, pp=1)")
    if p.tp > 1 and p.tp_mode == "1d":
        for name in ("n_heads", "d_ff", "vocab_size"):
            v = getattr(m, name, None)
            if v is not None and v % p.tp:
                raise _err(f"model.{name}={v} is not divisible by parallel.tp={p.tp}; pick a tp that "
                           f"divides it (or change model.{name})")
    if p.tp > 1:
        _check_tp_attention(p, m)
    if p.tp_mode != "1d":
        _check_grid_model(p, m, moe_cfg)
    if p.cp > 1:
        _check_cp_model(p, m, moe_cfg)
    _check_mtp_layout(p, m, getattr(m, "mtp_depth", 0))
    if p.pp > 1 and p.pp_schedule == "2bw" and getattr(m, "tie_embeddings", False):
        raise _err("parallel.pp_schedule=2bw with model.tie_embeddings=true: the first and last "
                   "stage would update one weight from two stashed versions; set "
                   "model.tie_embeddings=false (or use parallel.pp_schedule=1f1b)")
    if p.pp > 1 and p.pp_schedule in V_SCHEDULES and getattr(m, "tie_embeddings", False):
        raise _err(f"parallel.pp_schedule={p.pp_schedule} with model.tie_embeddings=true: the V puts "
                   f"both ends of the pipeline on rank 0, where torch 2.13's zero-bubble weight pass "
                   f"gets the shared weight's gradient wrong (measured); set "
                   f"model.tie_embeddings=false or use pp_schedule=zb_interleaved")
    if _has_moe(moe_cfg) and moe_cfg.num_experts % p.ep:
        raise _err(f"moe.num_experts={moe_cfg.num_experts} is not divisible by parallel.ep={p.ep}; "
                   f"pick an ep that divides it")
    if not _has_moe(moe_cfg) and p.ep > 1 and moe_cfg is not None:
        raise _err(f"parallel.ep={p.ep} needs MoE layers (moe.every=0 makes a dense model); set ep=1")
    if p.etp > 1:
        _check_etp_model(p, m, moe_cfg)
    _check_recompute_model(p, m, moe_cfg)


def _check_fp8(p: ParallelPlan, m, moe_cfg) -> None:
    """precision=fp8 (parallel/fp8.py): what it does not compose with yet, and the dims its
    128 x 128 weight blocks must tile (m, moe_cfg: None = not known here)."""
    if p.precision != "fp8":
        return
    for bad, what in ((p.tp > 1 and p.tp_mode != "1d", f"parallel.tp_mode={p.tp_mode}: the "
                       f"grid's SUMMA forwards run their own matmuls, not the FP8 ones; use "
                       f"tp_mode=1d"),
                      (p.param_dtype != "fp32", f"parallel.param_dtype={p.param_dtype}: the FP8 "
                       f"casts read fp32 masters; set param_dtype=fp32")):
        if bad:
            raise _err(f"parallel.precision=fp8 with {what} (or use precision=bf16)")
    dims = [("model.d_model", getattr(m, "d_model", None))]
    if moe_cfg is not None and _has_moe(moe_cfg) and getattr(moe_cfg, "d_ff", 0):
        dims.append(("moe.d_ff", moe_cfg.d_ff))
    dims.append(("model.d_ff", getattr(m, "d_ff", None)))
    rowwise = p.fp8_recipe == "rowwise"   # torch._scaled_grouped_mm: 16-byte rows of e4m3
    tile, why = (16, "the rowwise FP8 GEMMs' 16-byte alignment") if rowwise else \
        (128, "the expert GEMMs' 128 x 128 weight blocks")
    for name, v in dims:
        if isinstance(v, int) and v % tile:
            raise _err(f"parallel.precision=fp8 needs {name} to be a multiple of {tile} (got {v}: "
                       f"{why}); change {name} or use precision=bf16")
    d_ff = getattr(m, "d_ff", None)
    if p.tp > 1 and _has_dense_ffn(moe_cfg) and isinstance(d_ff, int) and d_ff % (128 * p.tp):
        raise _err(f"parallel.precision=fp8 with parallel.tp={p.tp} needs model.d_ff to be a "
                   f"multiple of 128 x tp = {128 * p.tp} (got {d_ff}: the dense FFN's d_ff is "
                   f"split tp ways and each slice must hold whole 128 x 128 blocks); change it "
                   f"or tp")
    expert_ff = (getattr(moe_cfg, "d_ff", 0) or getattr(m, "d_ff", 0)) if moe_cfg is not None else 0
    if p.etp > 1 and isinstance(expert_ff, int) and expert_ff % (128 * p.etp):
        raise _err(f"parallel.precision=fp8 with parallel.etp={p.etp} needs the experts' d_ff "
                   f"(moe.d_ff, or model.d_ff where it is 0) to be a multiple of 128 x etp = "
                   f"{128 * p.etp} (got {expert_ff}: each rank's slice must hold whole 128 x 128 "
                   f"blocks); change it or etp")


def _check_batch(p: ParallelPlan, batch_size: int, has_moe: bool, whole_sequences: bool) -> None:
    if batch_size % p.dp:
        raise _err(f"train.batch_size={batch_size} (global, in sequences) is not divisible by "
                   f"parallel.dp={p.dp}; use a multiple of {p.dp}")
    local = batch_size // p.dp
    mb = p.microbatches if p.pp > 1 else 1
    if p.pp > 1 and local % mb:
        raise _err(f"per-rank batch {local} (train.batch_size/dp) is not divisible by "
                   f"parallel.microbatches={mb}; pick microbatches dividing {local}")
    if p.pp > 1 and p.pp_schedule != "gpipe" and mb < p.pp:
        raise _err(f"parallel.microbatches={mb} is less than parallel.pp={p.pp}: schedule "
                   f"{p.pp_schedule} needs at least one microbatch per stage; raise microbatches")
    if p.pp > 1 and p.pp_schedule == "dualpipev" and mb < p.num_stages:
        raise _err(f"parallel.microbatches={mb}: pp_schedule dualpipev needs at least one microbatch "
                   f"per stage ({p.num_stages} = 2 x parallel.pp={p.pp}); raise microbatches to "
                   f"{p.num_stages} or more")
    rounds = max(1, mb // p.pp)
    if p.pp > 1 and p.pp_schedule == "zb_interleaved" and mb % rounds:
        raise _err(f"parallel.microbatches={mb}: pp_schedule zb_interleaved runs rounds of "
                   f"parallel.pp={p.pp} microbatches ({rounds} here) and needs a multiple of them; "
                   f"use a multiple of {p.pp}")
    rows = p.tp_depth * p.tp_grid
    if p.tp_mode != "1d" and (local // mb) % rows:
        raise _err(f"microbatch size {local // mb} sequences is not divisible by {rows} (parallel."
                   f"tp_mode={p.tp_mode} splits the batch over tp_depth x q = {p.tp_depth} x "
                   f"{p.tp_grid} grid rows); raise train.batch_size or lower parallel.microbatches")
    if p.tp > 1 and p.tp_mode != "1d" and has_moe and (local // mb) % p.tp:
        raise _err(f"microbatch size {local // mb} sequences is not divisible by parallel.tp={p.tp}: "
                   f"under tp_mode={p.tp_mode} MoE layers split whole sequences across tp ranks "
                   f"so each token is routed once; raise train.batch_size or lower "
                   f"parallel.microbatches")
    if p.tp > 1 and p.tp_mode == "1d" and whole_sequences and (local // mb) % p.tp:
        raise _err(f"microbatch size {local // mb} sequences is not divisible by parallel.tp={p.tp}: "
                   f"MoE layers with a capacity or expert choice route whole sequences, split "
                   f"across tp ranks; raise train.batch_size, lower parallel.microbatches, or "
                   f"route dropless token choice (moe.capacity_factor=none), which splits "
                   f"along the sequence")
