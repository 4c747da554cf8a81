"""Rank the layouts and print them: a table of those that fit (fastest first), the ones
that overflow memory with their peak, and the ones validate() or parallelize() refuse,
grouped by reason. `as_json` is the same content, machine-readable."""
from collections import defaultdict

from .enumerate import layouts, rejection
from .predict import predict

GB, MB = 1e9, 1e6
BUILD_ERRORS = (ValueError, NotImplementedError, TypeError)


def layout_name(plan) -> str:
    tp = {"1d": "", "2d": "(2d)", "2.5d": f"(2.5d,d{plan.tp_depth})"}[plan.tp_mode]
    parts = [f"dp{plan.dp}", f"tp{plan.tp}{tp}", f"pp{plan.pp}", f"ep{plan.ep}", f"z{plan.zero}"]
    if plan.cp > 1:
        parts.insert(1, f"cp{plan.cp}" + ("u" if plan.cp_mode == "ulysses" else ""))
    if plan.etp > 1:
        parts.insert(4, f"etp{plan.etp}")
    if plan.recompute != "none":
        parts.append("rc")
    if plan.offload != "none":
        parts.append(f"off={plan.offload[:3]}")
    quant = "+".join(n for n, on in (("qwZ", plan.zeropp_quantize_weights),
                                     ("qgZ", plan.zeropp_quantize_grads)) if on)
    if quant:
        parts.append(quant)
    if plan.zeropp_hpz:
        parts.append(f"hpZ{plan.zeropp_hpz}")
    if plan.pp > 1:
        parts.append(f"{plan.pp_schedule}/m{plan.microbatches}")
        counts = plan.pp_layers.split(",")
        if len(set(counts)) > 1:
            parts.append(f"L{'-'.join(counts)}")
    return " ".join(parts)


def plan_all(w, base, world: int, hw, costs, cache, **kw) -> dict:
    """{"fits": [Prediction] fastest first, "too_big": [Prediction], "invalid": [(plan, reason)]}."""
    ok, invalid = layouts(w, base, world, **kw)
    fits, too_big = [], []
    for plan in ok:
        try:
            pred = predict(w, plan, hw, costs, cache)
        except BUILD_ERRORS as e:  # validate passed but parallelize cannot build it
            invalid.append((plan, f"parallelize: {rejection(e)}"))
            continue
        (fits if pred.fits else too_big).append(pred)
    fits.sort(key=lambda p: p.step_s)
    too_big.sort(key=lambda p: p.peak_bytes)
    return {"fits": fits, "too_big": too_big, "invalid": invalid}


def _state_gb(stage) -> str:
    ms = stage.model_state
    return "/".join(f"{sum(ms[k].values()) / GB:.2f}" for k in ("params", "grads", "optimizer"))


def text(result: dict, top: int, hw) -> str:
    lines = [f"{len(result['fits'])} layouts fit in {hw.gpu_mem_gb:g} GB, "
             f"{len(result['too_big'])} overflow it, {len(result['invalid'])} are refused.", ""]
    head = (f"{'#':>3} {'layout':<44} {'peak GB':>8} {'p/g/opt GB (rank 0)':>20} {'act GB':>7} "
            f"{'comm MB':>9} {'bubble':>6} {'step ms':>9} {'min ms':>8} {'tok/s':>10}")
    lines += ["fits (fastest first):", head]
    for i, p in enumerate(result["fits"][:top], 1):
        s = p.rank0()
        comm = max((sum(st.comm_bytes.values()) for st in p.stages), default=0)
        lines.append(f"{i:>3} {layout_name(p.plan):<44} {p.peak_bytes / GB:>8.2f} {_state_gb(s):>20} "
                     f"{max(st.activation_bytes for st in p.stages) / GB:>7.2f} {comm / MB:>9.1f} "
                     f"{p.bubble:>6.2f} {p.step_s * 1e3:>9.4g} {p.step_s_min * 1e3:>8.4g} "
                     f"{p.tokens_per_s:>10.4g}")
    if len(result["fits"]) > top:
        lines.append(f"    ... {len(result['fits']) - top} more (--top N, or --json for all)")
    if result["fits"]:
        best = result["fits"][0].rank0()
        kinds = ", ".join(f"{k} {v / MB:.1f}" for k, v in best.comm_bytes.items()) or "none"
        lines.append(f"    #1 rank 0 comm MB/step: {kinds}")
    lines += ["", "do not fit (smallest peak first):"]
    for p in result["too_big"][:top]:
        lines.append(f"    {layout_name(p.plan):<44} {p.reason}")
    if len(result["too_big"]) > top:
        lines.append(f"    ... {len(result['too_big']) - top} more")
    lines += ["", "refused (count, reason, e.g.):"]
    groups = defaultdict(list)
    for plan, reason in result["invalid"]:
        groups[reason].append(plan)
    for reason, plans in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {len(plans):>5}  {reason}  [e.g. {layout_name(plans[0])}]")
    return "\n".join(lines)


def _plan_dict(plan) -> dict:
    keys = ("dp", "cp", "cp_mode", "tp", "tp_mode", "tp_depth", "pp", "ep", "etp", "zero",
            "recompute", "pp_schedule", "microbatches", "pp_layers",
            "pp_stages_per_rank", "precision", "offload", "zeropp_quantize_weights",
            "zeropp_quantize_grads", "zeropp_hpz", "zero_prefetch")
    return {k: getattr(plan, k) for k in keys}


def _pred_dict(p) -> dict:
    return {"layout": _plan_dict(p.plan), "fits": p.fits, "reason": p.reason,
            "peak_bytes": p.peak_bytes, "bubble": p.bubble, "step_s": p.step_s,
            "step_s_min": p.step_s_min,
            "tokens_per_s": p.tokens_per_s,
            "ranks": [{"rank": s.rank, "model_state_bytes": s.model_state,
                       "activation_bytes": s.activation_bytes,
                       "activation_bytes_per_microbatch": s.activation_per_microbatch,
                       "in_flight_microbatches": s.in_flight, "memory_bytes": s.memory,
                       "comm_bytes": s.comm_bytes, "wire_bytes": s.wire_bytes, "flops": s.flops, "comm_s": s.comm_s,
                       "step_s": s.step_s, "step_s_min": s.step_s_min} for s in p.stages]}


def as_json(result: dict, world: int, hw) -> dict:
    return {"world": world, "hardware": vars(hw),
            "fits": [_pred_dict(p) for p in result["fits"]],
            "too_big": [_pred_dict(p) for p in result["too_big"]],
            "invalid": [{"layout": _plan_dict(plan), "reason": r} for plan, r in result["invalid"]]}
