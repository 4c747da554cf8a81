"""python -m parallel.planner: the layouts that fit a train.py config on N GPUs, fastest first.

    python -m parallel.planner --config configs/gshard_gpt.toml --world 64
    python -m parallel.planner --config configs/switch_base.toml --world 32 --gpu-mem 40 --json
    python -m parallel.planner --world 8 model.d_model=1024 train.batch_size=64   (defaults + overrides)

Config files and `section.field=value` overrides are read exactly as train.py reads them
(trainer.config.load_config), and every candidate layout is checked by train.py's own
validation (trainer.config.validate, which runs ParallelPlan.validate), so a layout listed
here is one train.py accepts. The model is built on the meta device (no weights).

Layering: a command, at the top of the stack; nothing imports it. The planner library
(parallel/planner) takes the model as a build function and imports nothing above parallel/;
trainer/planning.py turns a train.py config into its Workload.
"""
import argparse
import json
import sys

from parallel.planner.flops import model_costs
from parallel.planner.predict import StateCache
from parallel.planner.report import as_json, plan_all, text
from parallel.planner.search import search
from parallel.planner.hardware import DATA_SHEETS, Hardware, preset, with_overrides
from trainer.planning import workload_from_config


def _parser() -> argparse.ArgumentParser:
    hw = Hardware()
    ap = argparse.ArgumentParser(
        prog="python -m parallel.planner",
        description="List the parallel layouts (dp, cp, tp, pp, ep, zero, recompute, pipeline "
                    "schedule and micro-batches) of a train.py config that fit N GPUs, ranked "
                    "by predicted step time, with per-rank memory, communication per step, "
                    "TFLOP/s per GPU and MFU, and the reason each other layout does not fit; "
                    "or check one layout (--layout). Models: see the docstrings of "
                    "parallel/planner/memory.py, comm.py, flops.py, step_time.py and hardware.py.",
        epilog="Anything after the options of the form section.field=value overrides the "
               "config, as for train.py (e.g. train.batch_size=256 moe.capacity_factor=1.25). "
               "--json fields per layout: layout (every parallel field), name, fits, reason, "
               "peak_bytes, peak_gb (per pipeline stage), step_s and step_s_min (upper and "
               "lower bound), tokens_per_s, tflops_per_gpu, mfu (null without a peak), "
               "comm_bytes (by ledger kind, busiest stage; expert_all_to_all_intra_node and "
               "_inter_node: its parts inside and across nodes), bubble, ranks (one per stage: "
               "model_state_bytes by kind and device, activation_bytes, memory_bytes by phase, "
               "comm_bytes, wire_bytes, flops, comm_s, step_s); with --layout also memory "
               "(per stage, by device and kind) and fixes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", help="train.py TOML config (default: train.py's built-in defaults)")
    ap.add_argument("--world", type=int, required=True, help="number of GPUs (ranks)")
    ap.add_argument("--hw", choices=sorted(DATA_SHEETS),
                    help="GPU preset: data-sheet peak, memory and links (hardware.py); the "
                         "options below override single figures")
    ap.add_argument("--gpu-mem", type=float, help=f"memory per GPU in GB (default {hw.gpu_mem_gb:g})")
    ap.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node, help="GPUs per node")
    ap.add_argument("--intra-bw", type=float, help=f"per-GPU collective bandwidth inside a node, GB/s (default {hw.intra_bw_gbs:g})")
    ap.add_argument("--inter-bw", type=float, help=f"per-GPU collective bandwidth between nodes, GB/s (default {hw.inter_bw_gbs:g})")
    ap.add_argument("--flops", type=float, help=f"achievable dense TFLOP/s per GPU (default {hw.tflops:g})")
    ap.add_argument("--peak-flops", type=float, help="data-sheet peak TFLOP/s per GPU, MFU's denominator (default: the preset's; none without --hw: no MFU)")
    ap.add_argument("--fp8-flops", type=float, help="achievable dense FP8 TFLOP/s per GPU, the rate of the blocks' GEMMs under parallel.precision=fp8 (default: the preset's FP8 peak x 0.68; none on the a100 or without --hw: the bf16 rate)")
    ap.add_argument("--host-bw", type=float, help=f"host<->GPU copy bandwidth for offload, GB/s (default {hw.host_bw_gbs:g})")
    ap.add_argument("--layout", help='check one layout instead of searching, e.g. "tp2 pp8 vp4 ep64 mbs1" '
                                     "(words: parallel/planner/check.py; omitted degrees: the config's)")
    ap.add_argument("--imbalance", type=float, default=1.0,
                    help="dropless MoE: rows the busiest expert-parallel rank receives / the mean "
                         "(1 = balanced; with a capacity factor it is capped by it)")
    ap.add_argument("--nodes-per-token", type=float, default=0.0,
                    help="measured distinct nodes a token's experts lie on (the nodes_per_token mean "
                         "of `python -m trainer.profile ... --nodes N`); prices moe.dispatch="
                         "hierarchical's bytes across nodes (0 = uniform routing's expectation, "
                         "under moe.max_nodes too)")
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3],
                    help="ZeRO stages to consider")
    ap.add_argument("--offload", nargs="+", default=["none", "optimizer", "params"],
                    choices=["none", "optimizer", "params"],
                    help="parallel.offload modes to consider")
    ap.add_argument("--zeropp", nargs="+", default=["off", "on"], choices=["off", "on"],
                    help="ZeRO++ to consider: on = qwZ+qgZ (ZeRO-3) / qgZ (ZeRO-2), and hpZ over "
                         "one node's dp ranks under ZeRO-3")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="context-parallel degrees to consider, those dividing the world "
                         "(each cp > 1 in both --cp-modes)")
    ap.add_argument("--cp-modes", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"],
                    help="context-parallel modes to consider")
    ap.add_argument("--top", type=int, default=10,
                    help="rows per table; the search predicts exactly every layout that can "
                         "still make this many fastest fitting ones")
    ap.add_argument("--exhaustive", action="store_true",
                    help="predict every candidate layout (slow beyond a few dozen GPUs) instead "
                         "of the bounded best-first search (parallel/planner/search.py), "
                         "whose top list is the same")
    ap.add_argument("--json", action="store_true", help="print every layout as JSON instead of tables")
    return ap


_POSITIVE = ("world", "top", "gpus_per_node", "gpu_mem", "intra_bw", "inter_bw", "flops",
             "peak_flops", "host_bw", "fp8_flops")


def _bad_numbers(args) -> str:
    """One line naming the first option whose number cannot be (a count or a rate of 0 or
    less, an imbalance below 1, a negative nodes-per-token), else ''."""
    for name in _POSITIVE:
        v = getattr(args, name, None)
        if v is not None and not v > 0:
            return f"--{name.replace('_', '-')} {v:g} must be > 0"
    if args.imbalance < 1:
        return f"--imbalance {args.imbalance:g} must be >= 1 (rows of the busiest rank / the mean)"
    if args.nodes_per_token < 0:
        return f"--nodes-per-token {args.nodes_per_token:g} must be >= 0 (0 = from the routing)"
    return ""


def _fp8_rate(hw: Hardware) -> str:
    return (f", FP8 GEMMs {hw.fp8_tflops:.1f} TFLOP/s" if hw.fp8_tflops else
            ", FP8 GEMMs at the bf16 rate (no FP8 rate known: --fp8-flops)")


def hardware(args) -> Hardware:
    base = preset(args.hw, args.gpus_per_node) if args.hw else Hardware(gpus_per_node=args.gpus_per_node)
    return with_overrides(base, gpu_mem_gb=args.gpu_mem, intra_bw_gbs=args.intra_bw,
                          inter_bw_gbs=args.inter_bw, tflops=args.flops, host_bw_gbs=args.host_bw,
                          peak_tflops=args.peak_flops, fp8_tflops=args.fp8_flops)


def main(argv=None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        print(f"error: unrecognized arguments {' '.join(bad)} (overrides look like "
              f"section.field=value)", file=sys.stderr)
        return 2
    wrong = _bad_numbers(args)
    if wrong:
        print(f"error: {wrong}", file=sys.stderr)
        return 2
    from trainer.config import ConfigError, check_sections, load_config
    try:
        cfg = load_config(args.config, overrides)
        check_sections(cfg)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hw = hardware(args)
    w = workload_from_config(cfg, args.imbalance, args.nodes_per_token)
    costs = model_costs(w.build_model(), w)
    head = (f"{args.config or 'defaults'} on {args.world} GPUs of {hw.gpu_mem_gb:g} GB "
            f"({hw.name}: {hw.gpus_per_node}/node, {hw.intra_bw_gbs:g}/{hw.inter_bw_gbs:g} GB/s "
            f"intra/inter, {hw.tflops:g} TFLOP/s achievable"
            + (f" of {hw.peak_tflops:g} peak" if hw.peak_tflops else "")
            + (_fp8_rate(hw) if cfg.parallel.precision == "fp8" else "") + "), global batch "
            f"{cfg.train.batch_size} x {'+'.join(str(v) for v in w.stream_tokens.values())} tokens")
    if args.layout:
        return check_layout(args, cfg, w, hw, costs, head)
    kw = dict(zeros=tuple(args.zero), offloads=tuple(args.offload),
              zeropp=tuple(z == "on" for z in args.zeropp), gpus_per_node=args.gpus_per_node,
              cps=tuple(args.cp), cp_modes=tuple(args.cp_modes))
    if args.exhaustive:
        result = plan_all(w, cfg.parallel, args.world, hw, costs, StateCache(w.build_model, w), **kw)
    else:
        result = search(w, cfg.parallel, args.world, hw, costs, StateCache(w.build_model, w),
                        top=args.top, **kw)
    if args.json:
        print(json.dumps(as_json(result, args.world, hw), indent=1))
    else:
        print(head)
        print(text(result, args.top, hw))
    return 0


def check_layout(args, cfg, w, hw, costs, head) -> int:
    import dataclasses
    from parallel.planner.check import breakdown, fixes, parse_layout, resolve_microbatches
    from parallel.planner.enumerate import with_default_layers
    from parallel.planner.predict import predict
    from parallel.planner.report import BUILD_ERRORS, layout_report, pred_dict
    cache = StateCache(w.build_model, w)
    try:
        fields, mbs = parse_layout(args.layout, cfg.parallel, cfg.train.batch_size)
        if mbs:
            w = dataclasses.replace(w, micro_batch_size=mbs)
        plan = resolve_microbatches(dataclasses.replace(cfg.parallel, **fields), args.world, w.batch_size)
        plan = w.validate(with_default_layers(plan, w.model_cfg.n_layers), args.world)
        pred = predict(w, plan, hw, costs, cache)
    except BUILD_ERRORS as e:
        line = str(e).strip().splitlines()[0]
        if "but the world size is" in line:  # the planner's fix is --world, not torchrun
            line = (f"--layout {args.layout!r} does not use the {args.world} GPUs of --world: "
                    f"{line.split(';')[0]}; pass --world with that many GPUs, or change the "
                    f"layout's words (dpN tpN ppN cpN)")
        print(f"error: {line}", file=sys.stderr)
        return 2

    def attempt(candidate):
        try:
            candidate = with_default_layers(candidate, w.model_cfg.n_layers)
            return predict(w, w.validate(candidate, args.world), hw, costs, cache)
        except BUILD_ERRORS:
            return None
    found = [] if pred.fits else fixes(attempt, plan)
    if args.json:
        out = pred_dict(pred)
        out["memory"] = breakdown(pred)
        out["fixes"] = [{"change": d, **pred_dict(p)} for d, p in found]
        print(json.dumps({"world": args.world, "hardware": vars(hw), "layout": out}, indent=1))
    else:
        print(head)
        print(layout_report(pred, breakdown(pred), found, hw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
