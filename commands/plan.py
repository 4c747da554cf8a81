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
from parallel.planner.step_time import Hardware
from trainer.planning import workload_from_config


def _parser() -> argparse.ArgumentParser:
    hw = Hardware()
    ap = argparse.ArgumentParser(
        prog="python -m parallel.planner",
        description="List the parallel layouts (dp, cp, tp, pp, ep, zero, recompute, pipeline "
                    "schedule and micro-batches) of a train.py config that fit N GPUs, ranked "
                    "by predicted step time, with per-rank memory, communication per step and "
                    "the reason each other layout does not fit. Models: see the docstrings of "
                    "parallel/planner/memory.py, comm.py, flops.py and step_time.py.",
        epilog="Anything after the options of the form section.field=value overrides the "
               "config, as for train.py (e.g. train.batch_size=256 moe.capacity_factor=1.25).")
    ap.add_argument("--config", help="train.py TOML config (default: train.py's built-in defaults)")
    ap.add_argument("--world", type=int, required=True, help="number of GPUs (ranks)")
    ap.add_argument("--gpu-mem", type=float, default=hw.gpu_mem_gb, help="memory per GPU in GB (default %(default)s)")
    ap.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node, help="GPUs per node (default %(default)s)")
    ap.add_argument("--intra-bw", type=float, default=hw.intra_bw_gbs, help="per-GPU bandwidth inside a node, GB/s (default %(default)s)")
    ap.add_argument("--inter-bw", type=float, default=hw.inter_bw_gbs, help="per-GPU bandwidth between nodes, GB/s (default %(default)s)")
    ap.add_argument("--flops", type=float, default=hw.tflops, help="achievable dense TFLOP/s per GPU (default %(default)s)")
    ap.add_argument("--host-bw", type=float, default=hw.host_bw_gbs, help="host<->GPU copy bandwidth for offload, GB/s (default %(default)s)")
    ap.add_argument("--imbalance", type=float, default=1.0,
                    help="dropless MoE: rows the busiest expert-parallel rank receives / the mean "
                         "(default %(default)s = balanced; with a capacity factor it is capped by it)")
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3],
                    help="ZeRO stages to consider (default all)")
    ap.add_argument("--offload", nargs="+", default=["none", "optimizer", "params"],
                    choices=["none", "optimizer", "params"],
                    help="parallel.offload modes to consider (default all)")
    ap.add_argument("--zeropp", nargs="+", default=["off", "on"], choices=["off", "on"],
                    help="ZeRO++ to consider: on = qwZ+qgZ (ZeRO-3) / qgZ (ZeRO-2), and hpZ over "
                         "one node's dp ranks under ZeRO-3 (default both)")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="context-parallel degrees to consider, those dividing the world "
                         "(default %(default)s; each cp > 1 in both --cp-modes)")
    ap.add_argument("--cp-modes", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"],
                    help="context-parallel modes to consider (default both)")
    ap.add_argument("--top", type=int, default=10, help="rows per table in the text output (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print every layout as JSON instead of tables")
    return ap


def main(argv=None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        print(f"error: unrecognized arguments {' '.join(bad)} (overrides look like "
              f"section.field=value)", file=sys.stderr)
        return 2
    from trainer.config import ConfigError, check_sections, load_config
    try:
        cfg = load_config(args.config, overrides)
        check_sections(cfg)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hw = Hardware(args.gpu_mem, args.gpus_per_node, args.intra_bw, args.inter_bw, args.flops,
                  args.host_bw)
    w = workload_from_config(cfg, args.imbalance)
    costs = model_costs(w.build_model(), w)
    result = plan_all(w, cfg.parallel, args.world, hw, costs, StateCache(w.build_model),
                      zeros=tuple(args.zero), offloads=tuple(args.offload),
                      zeropp=tuple(z == "on" for z in args.zeropp), gpus_per_node=args.gpus_per_node,
                      cps=tuple(args.cp), cp_modes=tuple(args.cp_modes))
    if args.json:
        print(json.dumps(as_json(result, args.world, hw), indent=1))
    else:
        print(f"{args.config or 'defaults'} on {args.world} GPUs of {args.gpu_mem:g} GB "
              f"({args.gpus_per_node}/node, {args.intra_bw:g}/{args.inter_bw:g} GB/s intra/inter, "
              f"{args.flops:g} TFLOP/s), global batch {cfg.train.batch_size} x "
              f"{'+'.join(str(v) for v in w.stream_tokens.values())} tokens")
        print(text(result, args.top, hw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
