"""The layout planner's search time against world size: the bounded best-first search
(parallel/planner/search.py) and, up to --exhaustive-upto, the exhaustive one timed in the
same run, with their top lists compared.

    python bench/planner_scale.py                      (gshard_gpt on H100s, worlds 8..256)
    python bench/planner_scale.py --worlds 8 16 --config configs/default.toml

Prints per world: seconds and layouts predicted by each, the speed-up, whether the top
--top lists are equal, and the best layout with its TFLOP/s per GPU and MFU.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parallel.planner import StateCache, preset  # noqa: E402
from parallel.planner.flops import model_costs  # noqa: E402
from parallel.planner.report import layout_name, plan_all  # noqa: E402
from parallel.planner.search import search  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.planning import workload_from_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gshard_gpt.toml")
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 64, 256])
    ap.add_argument("--exhaustive-upto", type=int, default=16)
    ap.add_argument("--hw", default="h100")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    w, hw = workload_from_config(cfg), preset(args.hw)
    costs = model_costs(w.build_model(), w)
    print(f"{args.config} on {args.hw}, top {args.top}, cp {args.cp}")
    for world in args.worlds:
        t = time.time()
        fast = search(w, cfg.parallel, world, hw, costs, StateCache(w.build_model), top=args.top,
                      cps=tuple(args.cp))
        t_fast = time.time() - t
        line = f"world {world:>5}: search {t_fast:7.1f} s, {fast['predicted']:>6} predicted"
        if world <= args.exhaustive_upto:
            t = time.time()
            full = plan_all(w, cfg.parallel, world, hw, costs, StateCache(w.build_model), cps=tuple(args.cp))
            t_full = time.time() - t
            same = [layout_name(p.plan) for p in full["fits"][:args.top]] == \
                [layout_name(p.plan) for p in fast["fits"][:args.top]]
            n = len(full["fits"]) + len(full["too_big"])
            line += f"; exhaustive {t_full:7.1f} s, {n:>6} predicted ({t_full / t_fast:.1f}x); top lists equal: {same}"
        print(line)
        if fast["fits"]:
            b = fast["fits"][0]
            mfu = "-" if b.mfu is None else f"{b.mfu:.0%}"
            print(f"    best: {layout_name(b.plan)}  {b.step_s * 1e3:.4g} ms/step, "
                  f"{b.tflops_per_gpu:.4g} TFLOP/s per GPU, MFU {mfu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
