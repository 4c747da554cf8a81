"""Rank the layouts and print them: a table of those that fit (fastest first), the ones
that overflow memory with their peak, and the ones validate() or parallelize() refuse,
grouped by reason. `as_json` is the same content, machine-readable."""
from collections import defaultdict

from .enumerate import layouts, rejection
from .predict import predict
from .memory import async_save_host_bytes
from .step_time import TERM_EVIDENCE

GB, MB = 1e9, 1e6
BUILD_ERRORS = (ValueError, NotImplementedError, TypeError)


def layout_name(plan) -> str:
    tp = {"1d": "", "2d": "(2d)", "2.5d": f"(2.5d,d{plan.tp_depth})"}[plan.tp_mode]
    parts = [f"dp{plan.dp}", f"tp{plan.tp}{tp}", f"pp{plan.pp}", f"ep{plan.ep}", f"z{plan.zero}"]
    if plan.cp > 1:
        parts.insert(1, f"cp{plan.cp}" + ("u" if plan.cp_mode == "ulysses" else ""))
    if plan.etp > 1:
        parts.insert(4, f"etp{plan.etp}")
    if plan.recompute == "full":
        parts.append("rc")
    elif plan.recompute == "selective":
        parts.append("rc=" + "+".join(plan.recompute_parts))
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


def rank_key(p) -> tuple:
    """Fastest first; equal predictions by layout name (so every search orders ties alike)."""
    return (p.step_s, layout_name(p.plan))


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
    fits.sort(key=rank_key)
    too_big.sort(key=lambda p: p.peak_bytes)
    return {"fits": fits, "too_big": too_big, "invalid": invalid}


def _mfu(p) -> str:
    return "-" if p.mfu is None else f"{p.mfu:.0%}"


def _state_gb(stage) -> str:
    ms = stage.model_state
    return "/".join(f"{sum(ms[k].values()) / GB:.2f}" for k in ("params", "grads", "optimizer"))


def text(result: dict, top: int, hw) -> str:
    if "examined" in result:  # the bounded search (search.py): what it looked at
        refused = sum(result["refused_counts"].values())
        lines = [f"best-first search: {result['predicted']} layouts predicted exactly "
                 f"({len(result['fits'])} fit in {hw.gpu_mem_gb:g} GB, {len(result['too_big'])} "
                 f"overflow it), {refused} refused; "
                 f"{result['bounded_slower'] + result['pruned_groups']} layout(s)/group(s) bounded "
                 f"slower than #{top}, {result['bounded_overflow'] + result['overflow_groups']} "
                 f"bounded over memory (parallel/planner/search.py; --exhaustive predicts all).", ""]
    else:
        lines = [f"{len(result['fits'])} layouts fit in {hw.gpu_mem_gb:g} GB, "
                 f"{len(result['too_big'])} overflow it, {len(result['invalid'])} are refused.", ""]
    head = (f"{'#':>3} {'layout':<44} {'peak GB':>8} {'p/g/opt GB (rank 0)':>20} {'act GB':>7} "
            f"{'comm MB':>9} {'bubble':>6} {'step ms':>9} {'min ms':>8} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>5}")
    lines += ["fits (fastest first):", head]
    for i, p in enumerate(result["fits"][:top], 1):
        s = p.rank0()
        comm = max((sum(st.comm_bytes.values()) for st in p.stages), default=0)
        lines.append(f"{i:>3} {layout_name(p.plan):<44} {p.peak_bytes / GB:>8.2f} {_state_gb(s):>20} "
                     f"{max(st.activation_bytes for st in p.stages) / GB:>7.2f} {comm / MB:>9.1f} "
                     f"{p.bubble:>6.2f} {p.step_s * 1e3:>9.4g} {p.step_s_min * 1e3:>8.4g} "
                     f"{p.tokens_per_s:>10.4g} {p.tflops_per_gpu:>8.4g} {_mfu(p):>5}")
    if len(result["fits"]) > top:
        lines.append(f"    ... {len(result['fits']) - top} more (--top N, or --json for all)")
    if result["fits"]:
        best = result["fits"][0].rank0()
        kinds = ", ".join(f"{k} {v / MB:.1f}" for k, v in best.comm_bytes.items()) or "none"
        lines.append(f"    #1 rank 0 comm MB/step: {kinds}")
    lines += ["", "do not fit (smallest peak first):" if result["too_big"] else
              "do not fit: none predicted (those bounded over memory are counted above)"]
    for p in result["too_big"][:top]:
        lines.append(f"    {layout_name(p.plan):<44} {p.reason}")
    if len(result["too_big"]) > top:
        lines.append(f"    ... {len(result['too_big']) - top} more")
    lines += ["", "refused (count, reason, e.g.):"]
    groups = defaultdict(list)
    for plan, reason in result["invalid"]:
        groups[reason].append(plan)
    counts = result.get("refused_counts") or {r: len(p) for r, p in groups.items()}
    for reason, plans in sorted(groups.items(), key=lambda kv: -counts[kv[0]]):
        lines.append(f"  {counts[reason]:>5}  {reason}  [e.g. {layout_name(plans[0])}]")
    return "\n".join(lines)


def _plan_dict(plan) -> dict:
    keys = ("dp", "cp", "cp_mode", "tp", "tp_mode", "tp_depth", "pp", "ep", "etp", "zero",
            "recompute", "recompute_modules", "pp_schedule", "microbatches", "pp_layers",
            "pp_stages_per_rank", "precision", "offload", "zeropp_quantize_weights",
            "zeropp_quantize_grads", "zeropp_hpz", "zero_prefetch")
    return {k: getattr(plan, k) for k in keys}


def comm_by_kind(p) -> dict:
    """{kind: bytes per step} of the busiest stage of each kind, and the expert all-to-all's
    bytes inside and across nodes (expert_all_to_all_intra_node / _inter_node: parts of
    expert_all_to_all, not more bytes)."""
    out = {}
    for st in p.stages:
        for k, v in st.comm_bytes.items():
            out[k] = max(out.get(k, 0), v)
    busiest = max(p.stages, key=lambda st: st.comm_bytes.get("expert_all_to_all", 0), default=None)
    return {**out, **(busiest.a2a_nodes if busiest is not None else {})}


def pred_dict(p) -> dict:
    return {"layout": _plan_dict(p.plan), "name": layout_name(p.plan), "fits": p.fits,
            "reason": p.reason, "peak_bytes": p.peak_bytes,
            "peak_gb": [s.memory["peak"] / GB for s in p.stages], "bubble": p.bubble,
            "step_s": p.step_s, "step_s_min": p.step_s_min, "tokens_per_s": p.tokens_per_s,
            "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "flops_per_token": p.flops_per_token,
            "mtp": p.mtp, "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu, "comm_bytes": comm_by_kind(p),
            "a2a_s": _a2a(p)[0], "a2a_exposed_s": _a2a(p)[1],
            "ranks": [{"rank": s.rank, "model_state_bytes": s.model_state,
                       "activation_bytes": s.activation_bytes,
                       "activation_bytes_per_microbatch": s.activation_per_microbatch,
                       "in_flight_microbatches": s.in_flight, "memory_bytes": s.memory,
                       "comm_bytes": s.comm_bytes, "wire_bytes": s.wire_bytes, "flops": s.flops, "comm_s": s.comm_s,
                       "step_s": s.step_s, "step_s_min": s.step_s_min,
                       "a2a_exposed_s": s.a2a_exposed_s,
                       "membound_bytes": s.membound_bytes, "membound_s": s.membound_s,
                       "breakdown_s": s.breakdown_s, "activation_terms_per_token": s.act_terms,
                       "async_save_host_bytes": async_save_host_bytes(s.model_state)}
                      for s in p.stages]}


def _a2a(p) -> tuple:
    """(seconds, exposed seconds) of the expert all-to-all on the stage where it is longest."""
    st = max(p.stages, key=lambda s: s.comm_s.get("expert_all_to_all", 0.0), default=None)
    return (0.0, 0.0) if st is None else (st.comm_s.get("expert_all_to_all", 0.0), st.a2a_exposed_s)


def as_json(result: dict, world: int, hw) -> dict:
    stats = {k: v for k, v in result.items() if k not in ("fits", "too_big", "invalid")}
    return {"world": world, "hardware": vars(hw), "search": stats,
            "fits": [pred_dict(p) for p in result["fits"]],
            "too_big": [pred_dict(p) for p in result["too_big"]],
            "invalid": [{"layout": _plan_dict(plan), "reason": r} for plan, r in result["invalid"]]}


def time_breakdown(p) -> list:
    """--layout's lines: each stage's predicted step by part (step_time.stage_breakdown), the
    part that weighs most on the slowest stage, and where each part comes from."""
    lines = ["", "step time per pipeline stage, ms (the parts sum to the stage's step; the "
                 "slowest stage is the step; negative: a gain):"]
    for i, st in enumerate(p.stages):
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in st.breakdown_s.items())
        lines.append(f"  stage {i}: {parts} = {st.step_s * 1e3:.1f}")
    slowest = max(p.stages, key=lambda st: st.step_s, default=None)
    if slowest is None or not slowest.breakdown_s or slowest.step_s <= 0:
        return lines
    part, sec = max(slowest.breakdown_s.items(), key=lambda kv: abs(kv[1]))
    lines.append(f"  the largest part of the slowest stage: {part}, {sec / slowest.step_s:.0%} of "
                 f"the step")
    used = {k for st in p.stages for k in st.breakdown_s}
    lines += ["where each part comes from:"] + [f"  {k}: {TERM_EVIDENCE[k]}"
                                               for k in TERM_EVIDENCE if k in used]
    return lines


def layout_report(pred, memory: list, found: list, hw) -> str:
    """--layout: fits or not, memory per stage by device and kind, bytes per step by kind,
    the step-time bounds, TFLOP/s per GPU and MFU; the fixes when it does not fit."""
    p = pred
    lines = [f"layout {layout_name(p.plan)}: "
             + ("fits" if p.fits else "does NOT fit") + f" in {hw.gpu_mem_gb:g} GB "
             f"(peak {p.peak_bytes / GB:.2f} GB)", "",
             "memory per pipeline stage, GB (gpu; cpu = offloaded):",
             f"  {'stage':>5} {'rank':>6} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
             f"{'buffers':>8} {'peak':>8}   cpu p/g/opt"]
    for i, (row, st) in enumerate(zip(memory, p.stages)):
        g, c = row["gpu"], row["cpu"]
        lines.append(f"  {i:>5} {row['rank']:>6} {g['params'] / GB:>8.2f} {g['grads'] / GB:>8.2f} "
                     f"{g['optimizer'] / GB:>8.2f} {g['activations'] / GB:>8.2f} "
                     f"{g['buffers'] / GB:>8.2f} {st.memory['peak'] / GB:>8.2f}   "
                     f"{c['params'] / GB:.2f}/{c['grads'] / GB:.2f}/{c['optimizer'] / GB:.2f}")
    terms = p.stages[0].act_terms if p.stages else {}
    if terms:
        lines += ["", "saved for backward per token of stage 0's first MoE block (else its first "
                      "block), elements, before recomputation (x bytes per element x tokens per "
                      "micro-batch-chunk, divided by tp and cp):",
                  "  " + ", ".join(f"{k} {v:.0f}" for k, v in terms.items())
                  + f" = {sum(terms.values()):.0f}"]
        save = p.stages[0].gates_saving
        if save:
            lines.append(f"  moe.gates_in_experts=true keeps {save:.0f} of them less ({save / sum(terms.values()):.0%}: "
                         f"the combine's saved outputs and the activation output; moe/row_gates.py)")
    if p.mtp:
        t = p.mtp
        lines += ["", f"multi-token prediction ({t['depths']} depth{'s' * (t['depths'] > 1)}, on the last "
                      f"stage): {t['params'] / 1e6:.2f} M parameters, {t['flops_per_token'] / 1e9:.3g} "
                      f"GFLOP per token of the {p.flops_per_token / 1e9:.4g} above "
                      f"({t['flops_per_token'] / p.flops_per_token:.1%}), {t['saved_elems_per_token']:.0f} "
                      f"elements per token saved for backward per depth (its block, its norms and "
                      f"projection, its logits; in the stage's activations)"]
    comm = comm_by_kind(p)
    lines += ["", "bytes per step by kind (busiest stage), MB: "
              + (", ".join(f"{k} {v / MB:.1f}" for k, v in sorted(comm.items())) or "none"),
              *([f"expert all-to-all {_a2a(p)[0] * 1e3:.4g} ms a step, {_a2a(p)[1] * 1e3:.4g} ms of it "
                 f"exposed with the overlap (busiest stage)"] if _a2a(p)[0] else []),
              f"step {p.step_s * 1e3:.4g} ms predicted (.. {p.step_s_min * 1e3:.4g} ms with every "
              f"overlap hiding all it can), "
              f"bubble {p.bubble:.2f}, {p.tokens_per_s:.4g} tokens/s, "
              f"{p.tflops_per_gpu:.4g} TFLOP/s per GPU, MFU {_mfu(p)}",
              *time_breakdown(p),
              "checkpoint save: each rank writes its own slices and shards (nothing gathered; "
              "one tensor at a time through host memory); checkpoint.async stages "
              f"{max(async_save_host_bytes(st.model_state) for st in p.stages) / GB:.2f} GB "
              "per rank in host memory (busiest stage)"]
    if not p.fits:
        lines += ["", "smallest changes that fit (fastest first):" if found else
                  "no change of one or two settings makes it fit: try more GPUs or a smaller batch"]
        for desc, q in found:
            lines.append(f"  {desc:<44} -> {layout_name(q.plan)}: peak {q.peak_bytes / GB:.2f} GB, "
                         f"step {q.step_s * 1e3:.4g} ms, MFU {_mfu(q)}")
    return "\n".join(lines)
