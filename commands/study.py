"""What experts buy: the scaling study, on your config and data.

  python -m trainer.study scaling --config F [--experts 1,2,4,8,16,32] [--top-k K]
                                  [--steps N] [--out DIR] [--nproc P] [--optimizers adamw,muon]
                                  [section.field=value ...]

Trains, with the same data, seed, schedule and token budget, a dense model (E = 1) and MoE
models that differ only in the number of experts E, at equal active parameters and FLOPs per
token: every MoE block's experts have d_ff = model.d_ff / K (K = top-k), so a token's K
experts hold exactly the dense FFN's parameters; the dense model is the same architecture with
moe.every = 0. Two more dense models at 2x and 4x FFN width (the dense ladder, --dense-ladder)
give the dense size law that turns losses into effective dense multipliers.

Each point is an ordinary run directory DIR/<point> (train.py, checkpoints every evaluation):
a rerun skips finished points and resumes an interrupted one. Results: DIR/study.json,
DIR/study.csv, DIR/study.png (commands/study_fit.py: curves, fits). --nproc P runs each point
under torchrun with P processes (e.g. with parallel.ep=2: each MoE point uses ep = gcd(ep, E);
layouts compute the same function, so the numbers are those of one process).

--optimizers adamw,muon trains every dense and MoE point once per optimizer (train.optimizer;
directories <point>-<optimizer>), on the same data, seed and schedule; the dense ladder and
the fits use the first optimizer's points. "tokens to dense" is always measured against the
dense model of the first optimizer (AdamW's, the usual baseline), so a Muon point shows the
tokens it needs to reach AdamW's dense loss; study.json keeps every point's validation curve
(tokens, loss) and the table below the main one shows them at a quarter, half, three quarters
and the end of the budget.
"""
import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("point", "experts", "top_k", "total_params", "active_params", "router_params", "tokens",
          "final_val_loss", "best_val_loss", "steps_to_dense", "tokens_to_dense",
          "seconds_to_dense", "wall_s", "tokens_per_s", "step_time_ratio", "dense_multiplier",
          "optimizer")


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m trainer.study", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="study", required=True)
    sc = sub.add_parser("scaling", help="dense vs MoE at equal active size, E = --experts",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sc.add_argument("--config", default=None, help="train.py TOML config (default: the built-in defaults)")
    sc.add_argument("--experts", default="1,2,4,8,16,32", help="comma list of E; 1 = the dense model")
    sc.add_argument("--top-k", type=int, default=None, help="experts per token (default: the config's moe.top_k)")
    sc.add_argument("--steps", type=int, default=None, help="steps per point (default: the config's train.steps)")
    sc.add_argument("--out", default=None, help="study directory (default runs/study-<config name>)")
    sc.add_argument("--nproc", type=int, default=1, help="processes per point (torchrun when > 1)")
    sc.add_argument("--dense-ladder", default="2,4",
                    help="extra dense widths (multiples of model.d_ff) for the effective-multiplier law; '' = none")
    sc.add_argument("--optimizers", default=None,
                    help="comma list of train.optimizer values, each point trained with each (e.g. "
                         "adamw,muon; default: the config's train.optimizer alone)")
    sc.add_argument("overrides", nargs="*", help="section.field=value applied to every point")
    return ap.parse_args(argv)


def _points(base, experts: list, K: int, ladder: list, ep: int) -> list:
    """[(name, kind, E, overrides)]: dense E=1, the MoE points, the dense ladder."""
    F = base.model.d_ff
    out = []
    for E in experts:
        if E == 1:
            out.append(("E1_dense", "dense", 1, ["moe.every=0", "parallel.ep=1"]))
        else:
            out.append((f"E{E}", "moe", E, [f"moe.every={base.moe.every}", f"moe.num_experts={E}",
                                            f"moe.top_k={K}", f"moe.d_ff={F // K}",
                                            f"parallel.ep={math.gcd(ep, E)}"]))
    for m in ladder:
        out.append((f"dense_x{m}", "dense_ladder", 1, ["moe.every=0", "parallel.ep=1", f"model.d_ff={F * m}"]))
    return out


def _with_optimizers(points: list, optimizers: list) -> list:
    """[(name, kind, E, overrides, optimizer)]: one optimizer keeps the names; several train
    every dense and MoE point with each (<name>-<optimizer>), the ladder with the first."""
    if len(optimizers) == 1:
        return [(n, k, E, over + [f"train.optimizer={optimizers[0]}"], optimizers[0]) for n, k, E, over in points]
    out = []
    for n, k, E, over in points:
        for opt in (optimizers if k != "dense_ladder" else optimizers[:1]):
            out.append((f"{n}-{opt}", k, E, over + [f"train.optimizer={opt}"], opt))
    return out


def _check(base, experts, K, steps, nproc) -> None:
    from trainer.config import ConfigError
    if base.moe.every == 0:
        raise ConfigError("the study compares MoE blocks with dense ones: the config has moe.every=0; "
                          "use a config with MoE blocks (moe.every >= 1)")
    if not experts or any(e < 1 for e in experts):
        raise ConfigError(f"--experts {experts}: give positive expert counts, e.g. 1,2,4,8")
    if K < 1 or base.model.d_ff % K:
        raise ConfigError(f"--top-k {K}: model.d_ff={base.model.d_ff} must split into K equal experts "
                          f"(d_ff / K); choose K dividing it")
    if any(1 < e < K for e in experts):
        raise ConfigError(f"--experts {experts} with --top-k {K}: every MoE point needs E >= K")
    if steps < 1 or nproc < 1:
        raise ConfigError("--steps and --nproc must be >= 1")


def _point_cfg(args, base_over, over, steps, eval_every, run_dir):
    return base_over + over + [f"train.steps={steps}", f"train.eval_every={eval_every}",
                               f"checkpoint.every={eval_every}", f"run.dir={run_dir}"]


def _done(run_dir: Path, steps: int) -> bool:
    from trainer import checkpoint
    last = checkpoint.latest(run_dir) if run_dir.is_dir() else None
    return last is not None and checkpoint.read_trainer_state(last)["step"] >= steps


def _launch(args, point_over, nproc, name, index, total) -> None:
    cmd = [sys.executable, "train.py"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "train.py"]
    cmd += (["--config", args.config] if args.config else []) + point_over
    print(f"[{index}/{total}] {name}: {' '.join(point_over[-6:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    tail = []
    for line in proc.stdout:   # the point's own progress, prefixed
        tail = (tail + [line])[-30:]
        if line.startswith(("step ", "run dir", "error", "saved")) or "Error" in line:
            print(f"  {name} | {line.rstrip()}", flush=True)
    if proc.wait() != 0:
        from trainer.config import ConfigError
        raise ConfigError(f"point {name} failed (exit {proc.returncode}); its last lines:\n"
                          + "".join(tail) + "rerun the study to resume it")


def _counts(cfg) -> dict:
    import models
    from moe import MoELayer
    model = models.build_model(cfg.model, cfg.moe, device="meta")
    c = models.count_params(model)
    router = sum(p.numel() for m in model.modules() if isinstance(m, MoELayer)
                 for p in m.router.parameters())
    return {"total_params": c["total"], "active_params": c["active_per_token"] - router,
            "router_params": router}


def run_study(argv) -> int:
    from commands import study_fit as sf
    from trainer.config import load_config, validate
    args = _args(argv)
    base = load_config(args.config, args.overrides)
    experts = [int(e) for e in args.experts.split(",") if e.strip()]
    K = args.top_k or base.moe.top_k
    steps = args.steps or base.train.steps
    ladder = [int(m) for m in args.dense_ladder.split(",") if m.strip()]
    _check(base, experts, K, steps, args.nproc)
    out = Path(args.out or f"runs/study-{base.run.name}")
    eval_every = max(1, steps // 10)
    optimizers = [o.strip() for o in (args.optimizers or base.train.optimizer).split(",") if o.strip()]
    if not optimizers or len(set(optimizers)) != len(optimizers):
        from trainer.config import ConfigError
        raise ConfigError(f"--optimizers {args.optimizers!r}: give distinct train.optimizer values, e.g. adamw,muon")
    points = _with_optimizers(_points(base, experts, K, ladder, base.parallel.ep), optimizers)
    cfgs = {}
    for name, kind, E, over, _ in points:   # every point's config checked before any run
        cfgs[name] = load_config(args.config, args.overrides + _point_cfg(args, [], over, steps, eval_every, out / name))
        validate(cfgs[name], args.nproc)
    out.mkdir(parents=True, exist_ok=True)
    print(f"study: {len(points)} points x {steps} steps ({base.train.batch_size} x {base.data.seq_len} "
          f"tokens per step), top-{K}, experts of d_ff {base.model.d_ff // K} -> {out}", flush=True)
    t0 = time.perf_counter()
    for i, (name, kind, E, over, _) in enumerate(points, 1):
        if _done(out / name, steps):
            print(f"[{i}/{len(points)}] {name}: done, skipped", flush=True)
            continue
        resume = ["train.resume=true"] if (out / name).exists() else []
        _launch(args, _point_cfg(args, args.overrides, over, steps, eval_every, out / name) + resume,
                args.nproc, name, i, len(points))
    results = _collect(out, points, cfgs, K, sf)
    _write(out, results, K, steps, sf)
    print(f"study done in {time.perf_counter() - t0:.0f} s: {out / 'study.json'}, study.csv, study.png")
    return 0


def _collect(out, points, cfgs, K, sf) -> dict:
    rows = []
    for name, kind, E, _, opt in points:
        cfg = cfgs[name]
        p = sf.read_point(out / name)
        if not p["evals"]:
            from trainer.config import ConfigError
            raise ConfigError(f"point {name} logged no validation loss; raise --steps")
        tps = cfg.train.batch_size * cfg.data.seq_len
        rows.append(dict(point=name, optimizer=opt, kind=kind, experts=E, top_k=K if kind == "moe" else None,
                         label=name, tokens_per_step=tps, evals=p["evals"], **_counts(cfg),
                         tokens=tps * len(p["rows"]), final_val_loss=p["evals"][-1][1],
                         best_val_loss=min(v for _, v in p["evals"]), wall_s=sum(p["step_times"]),
                         median_step_s=sf.median_step(p), _point=p))
    first = rows[0]["optimizer"]
    dense = next(r for r in rows if r["kind"] == "dense" and r["optimizer"] == first)
    ladder = [r for r in rows if r["kind"] in ("dense", "dense_ladder") and r["optimizer"] == first]
    law = sf.dense_law([r["active_params"] for r in ladder], [r["final_val_loss"] for r in ladder])
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["wall_s"] if r["wall_s"] else None
        r["step_time_ratio"] = r["median_step_s"] / dense["median_step_s"]
        r["steps_to_dense"], r["tokens_to_dense"], r["seconds_to_dense"] = \
            sf.reach(r.pop("_point"), dense["final_val_loss"], r["tokens_per_step"])
        r["dense_multiplier"] = sf.multiplier(law, r["final_val_loss"], dense["active_params"])
    routed = [r for r in rows if r["kind"] != "dense_ladder" and r["optimizer"] == first]
    fitted = sf.fit([r["experts"] for r in routed], [r["final_val_loss"] for r in routed]) \
        if len(routed) >= 2 else None
    ladder_losses = {r["point"]: round(r["final_val_loss"], 4) for r in ladder}
    if law:
        used = [r["point"] for r in sorted(ladder, key=lambda r: r["active_params"])][:law[2]]
        dense_law = {"c": law[0], "alpha": law[1], "points": used}
    else:
        dense_law = {"none": f"the dense ladder's loss does not fall with size ({ladder_losses}): "
                             f"no multiplier"} if len(ladder) > 1 else None
    return {"points": rows, "fit": fitted, "dense_law": dense_law}


def _write(out, results, K, steps, sf) -> None:
    (out / "study.json").write_text(json.dumps(dict(results, top_k=K, steps=steps), indent=1))
    with open(out / "study.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in results["points"]:
            w.writerow(r)
    if results["fit"] is not None:
        first = results["points"][0]["optimizer"]  # the fits are the first optimizer's
        sf.plot(out / "study.png", [r for r in results["points"] if r["optimizer"] == first], results["fit"])
    _print_table(results)


def _print_table(results) -> None:
    w = max(10, *(len(r["point"]) for r in results["points"]))
    print(f"{'point':<{w}} {'E':>3} {'total M':>8} {'active M':>9} {'final val':>9} {'best val':>9} "
          f"{'tok to dense':>12} {'step x dense':>12} {'x dense size':>12}")
    for r in results["points"]:
        to = f"{r['tokens_to_dense']:,}" if r["tokens_to_dense"] else "-"
        mult = f"{r['dense_multiplier']:.2f}" if r["dense_multiplier"] else "-"
        print(f"{r['point']:<{w}} {r['experts']:>3} {r['total_params'] / 1e6:>8.2f} {r['active_params'] / 1e6:>9.3f} "
              f"{r['final_val_loss']:>9.4f} {r['best_val_loss']:>9.4f} {to:>12} {r['step_time_ratio']:>12.2f} {mult:>12}")
    if len({r["optimizer"] for r in results["points"]}) > 1:
        _print_curves(results["points"], w)
    law = results["dense_law"]
    if law and "none" in law:
        print(law["none"])
    elif law:
        print(f"dense size law (x dense size): log L = {law['c']:.4f} + {law['alpha']:.4f} log N_active "
              f"over {', '.join(law['points'])}")
    f = results["fit"]
    if f:
        p = f["power"]
        print(f"fit log L = a + b log E: a={p['a']:.4f} b={p['b']:.4f} (SSE {p['sse']:.2e})")
        if f.get("saturating"):
            s = f["saturating"]
            print(f"saturating: a={s['a']:.4f} b={s['b']:.4f} E_start={s['E_start']} E_max={s['E_max']} "
                  f"(SSE {s['sse']:.2e}); better by AIC: {f['better']}")


def _print_curves(rows, w) -> None:
    """Validation loss against tokens: at the evaluation nearest a quarter, half, three
    quarters and all of the budget (several optimizers: one curve per point and optimizer)."""
    curves = {r["point"]: [(step * r["tokens_per_step"], v) for step, v in r["evals"]] for r in rows}
    budget = max(t for c in curves.values() for t, _ in c)
    marks = [budget * q // 4 for q in (1, 2, 3, 4)]
    print(f"\nvalidation loss at tokens (dense reference: {rows[0]['point']})")
    print(f"{'point':<{w}} " + " ".join(f"{m:>10,}" for m in marks))
    for r in rows:
        if r["kind"] == "dense_ladder":
            continue
        at = [min(curves[r["point"]], key=lambda e: abs(e[0] - m))[1] for m in marks]
        print(f"{r['point']:<{w}} " + " ".join(f"{v:>10.4f}" for v in at))


def main(argv=None) -> int:
    from trainer.config import ConfigError
    try:
        return run_study(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
