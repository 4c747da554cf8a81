"""The ZeRO-stage study on paper: the layout planner's predictions for T5/Switch-style
encoder-decoder models of 0.6B-13B parameters under ZeRO 0/1/2/3 on 8-64 GPUs.

    python bench/zero_study.py [--gpus 8 16 32 64] [--models 0.6B 1.2B] [--out docs/zero_study]

Nothing is trained and no weights exist: each model is built on the meta device
(model.arch='switch' with moe.every=0: the dense T5-style encoder-decoder of models/switch.py,
relu FFNs, tied 32,128-token embedding) and parallel/planner predicts one rank of pure data
parallelism (tp = pp = ep = 1) at each ZeRO stage. Setting (stated, not the paper's):
span corruption of 512-token samples (encoder 463, decoder 64 tokens after corruption),
4 sequences per GPU (global batch 4 x GPUs), bf16 autocast with fp32 master weights (so
model state is 16 bytes per parameter at ZeRO-0: fp32 params, grads, 2 Adam moments),
full activation recomputation, AdamW. Hardware for the time column: the planner defaults
(150 TFLOP/s, 150/25 GB/s intra/inter-node, 8 GPUs per node, 25 GB/s host copies). ZeRO 1-3
also with parallel.offload=optimizer ("+off": fp32 masters and Adam moments on the host, so
the GPU keeps params and gradients only; the host copies add to the predicted time).

Printed and written to OUT.md: per-GPU model state and peak, which of 40/80 GB it fits,
wire bytes per step and their ratio to ZeRO-0, predicted tokens/s. OUT.png plots peak
memory against GPUs and the communication ratio.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.planner import Hardware, StateCache, predict  # noqa: E402
from trainer.planning import workload_from_config  # noqa: E402
from parallel.planner.enumerate import rejection  # noqa: E402
from parallel.planner.flops import model_costs  # noqa: E402
from parallel.planner.report import BUILD_ERRORS  # noqa: E402
from trainer.config import load_config  # noqa: E402

# name -> (d_model, d_ff, layers per stack, heads): params counted from the built model
MODELS = {"0.6B": (1024, 4096, 19, 16), "1.2B": (1536, 6144, 17, 24), "3B": (2048, 8192, 25, 32),
          "6B": (3072, 12288, 22, 48), "13B": (4096, 16384, 28, 64)}
PER_GPU_BATCH = 4
STAGES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"),
          (1, "optimizer"), (2, "optimizer"), (3, "optimizer")]
GB = 1e9


def config(shape, gpus: int):
    d, f, layers, heads = shape
    return load_config(None, [
        "model.arch=switch", "model.vocab_size=32128", f"model.d_model={d}", f"model.d_ff={f}",
        f"model.n_layers={layers}", f"model.n_heads={heads}", "model.max_seq_len=512",
        "model.activation=relu", "moe.every=0", "data.seq_len=512",
        f"train.batch_size={PER_GPU_BATCH * gpus}", "parallel.precision=bf16",
        "parallel.recompute=full", f"parallel.dp={gpus}"])


def study(models, gpus_list, hw):
    rows = []
    for name in models:
        for gpus in gpus_list:
            cfg = config(MODELS[name], gpus)
            w = workload_from_config(cfg)
            model = w.build_model()
            params = sum(p.numel() for p in model.parameters())
            costs, cache = model_costs(model, w), StateCache(w.build_model)
            base = None
            for zero, offload in STAGES:
                plan = w.validate(cfg.parallel.__class__(**{**vars(cfg.parallel), "zero": zero,
                                                             "offload": offload}), gpus)
                try:
                    p = predict(w, plan, hw, costs, cache)
                except BUILD_ERRORS as e:  # a layout parallelize() refuses: say why
                    rows.append(dict(model=name, params=params, gpus=gpus, zero=zero,
                                     offload=offload, refused=rejection(e)))
                    continue
                s = p.rank0()
                state = sum(v.get("gpu", 0) for v in s.model_state.values())  # on the GPU
                base = base or s.wire_bytes
                rows.append(dict(model=name, params=params, gpus=gpus, zero=zero, offload=offload, state=state,
                                 peak=p.peak_bytes, wire=s.wire_bytes, ratio=s.wire_bytes / base,
                                 tokens_per_s=p.tokens_per_s))
            print(f"  {name} on {gpus} GPUs done", file=sys.stderr, flush=True)
    return rows


def table(rows) -> str:
    out = ["| model | params | GPUs | ZeRO | model state on GPU, GB | peak GB/GPU | fits 40 GB | fits 80 GB "
           "| wire GB/step/GPU | vs ZeRO-0 | tokens/s (pred.) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stage = f"{r['zero']}" + ("+off" if r["offload"] != "none" else "")
        if "refused" in r:
            out.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['gpus']} | {stage} "
                       f"| refused: {r['refused']} |||||||")
            continue
        out.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['gpus']} | {stage} "
                   f"| {r['state'] / GB:.1f} | {r['peak'] / GB:.1f} "
                   f"| {'yes' if r['peak'] <= 40 * GB else 'no'} | {'yes' if r['peak'] <= 80 * GB else 'no'} "
                   f"| {r['wire'] / GB:.2f} | {r['ratio']:.2f} "
                   f"| {r['tokens_per_s']:,.0f} |")
    return "\n".join(out)


STAGE_STYLE = {  # (zero, offloaded) -> colour, marker, line style: every stage its own look
    (0, False): ("black", "o", "-"), (1, False): ("tab:blue", "s", "-"),
    (2, False): ("tab:orange", "^", "-"), (3, False): ("tab:green", "D", "-"),
    (1, True): ("tab:blue", "s", "--"), (2, True): ("tab:orange", "^", "--"),
    (3, True): ("tab:green", "D", "--")}


def _stage_label(zero: int, off: bool) -> str:
    return f"ZeRO-{zero}" + (" + offload=optimizer" if off else "")


def _series(rows, key, **match):
    return [(r["gpus"], r[key]) for r in rows
            if key in r and all(r[k] == v for k, v in match.items())]


def _mean_over_models(rows, gpus, key, zero, offload):
    pts = []
    for g in gpus:
        xs = [r[key] for r in rows if key in r and r["gpus"] == g and r["zero"] == zero
              and r["offload"] == offload]
        if xs:
            pts.append((g, sum(xs) / len(xs)))
    return pts


def plot(rows, path: str) -> None:
    """One memory panel per model (model state on the GPU, every stage with and without
    offload: the quantity ZeRO partitions; peaks and the 40/80 GB fit are in the table), then
    communication and predicted throughput relative to ZeRO-0, and the legend alone."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    gpus = sorted({r["gpus"] for r in rows})
    ncol = 4
    nrow = -(-(len(models) + 3) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.4 * nrow))
    axes = axes.reshape(-1)
    for ax, m in zip(axes, models):
        for (z, off), (c, mk, ls) in STAGE_STYLE.items():
            pts = _series(rows, "state", model=m, zero=z, offload="optimizer" if off else "none")
            if pts:
                ax.plot([g for g, _ in pts], [v / GB for _, v in pts], ls, color=c, marker=mk,
                        ms=5, mfc="white" if off else c, lw=1.2)
        ax.set(yscale="log", title=f"{m}: model state GB per GPU", xlabel="GPUs")
    k = len(models)
    comm, thr, leg = axes[k], axes[k + 1], axes[k + 2]
    for (z, off), (c, mk, ls) in STAGE_STYLE.items():
        offload = "optimizer" if off else "none"
        if not off:  # offload moves no extra bytes: its ratio is its stage's
            pts = _mean_over_models(rows, gpus, "ratio", z, offload)
            comm.plot(*zip(*pts), ls, color=c, marker=mk, ms=5)
        base = {g: v for g, v in _mean_over_models(rows, gpus, "tokens_per_s", 0, "none")}
        pts = [(g, v / base[g]) for g, v in _mean_over_models(rows, gpus, "tokens_per_s", z,
                                                              offload) if g in base]
        if pts:
            thr.plot(*zip(*pts), ls, color=c, marker=mk, ms=5, mfc="white" if off else c)
        leg.plot([], [], ls, color=c, marker=mk, mfc="white" if off else c,
                 label=_stage_label(z, off))
    comm.set(title="wire bytes / ZeRO-0 (mean over models)\noffload: same as its stage",
             xlabel="GPUs", ylim=(0, 2))
    thr.set(title="predicted tokens/s / ZeRO-0\n(mean over models)", xlabel="GPUs", ylim=(0, 1.1))
    leg.legend(loc="center", fontsize=10, frameon=False)
    leg.axis("off")
    for ax in axes[k + 3:]:
        ax.axis("off")
    for ax in axes[:k + 2]:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(gpus, [str(g) for g in gpus])
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def rows_from_table(path: str) -> list:
    """The rows of a table written by `table` (--replot: redraw without re-running)."""
    rows = []
    for line in open(path).read().splitlines()[2:]:
        c = [x.strip() for x in line.strip("|").split("|")]
        zero, off = int(c[3][0]), c[3].endswith("+off")
        r = dict(model=c[0], gpus=int(c[2]), zero=zero, offload="optimizer" if off else "none")
        if not c[4].startswith("refused"):
            r.update(state=float(c[4]) * GB, peak=float(c[5]) * GB, ratio=float(c[9]),
                     tokens_per_s=float(c[10].replace(",", "")))
        rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", default="docs/zero_study", help="writes OUT.md and OUT.png")
    ap.add_argument("--replot", action="store_true", help="redraw OUT.png from OUT.md only")
    args = ap.parse_args()
    if args.replot:
        plot(rows_from_table(args.out + ".md"), args.out + ".png")
        print(f"wrote {args.out}.png")
        return
    rows = study(args.models, args.gpus, Hardware())
    text = table(rows)
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    plot(rows, args.out + ".png")
    print(f"wrote {args.out}.md and {args.out}.png")


if __name__ == "__main__":
    main()
