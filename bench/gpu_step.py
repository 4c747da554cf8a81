"""Training-step speed of a Qwen3-30B-A3B-shaped MoE against its dense twin of equal active
FLOPs, through train.py's own code path, in one process.

    python bench/gpu_step.py [--steps 8] [--warmup 3] [--modes eager,compiled] [--quick]

The MoE (issue 59's): 8 blocks, d_model 2048, 16 heads with 4 KV heads of width 128, qk-norm,
swiglu, 64 experts top-8 of d_ff 768 in every block, 2048-token sequences, global batch 16 in
micro-batches of 8, byte tokens. The dense twin: the same blocks with `moe.every=0
model.d_ff=6144` (8 x 768: the same active FLOPs per token). Each (model, mode) is one
train.py run (trainer.run.run on a config built from these overrides, parallel.precision=bf16,
parallel.compile=false or true), and its figures are read from the run's metrics.jsonl: the
median tokens/s, TFLOP/s and MFU (model FLOPs, the planner's count, over the device's
data-sheet peak) of the steps after --warmup, and the CUDA allocator's peak. Rows are printed
with the MoE's tokens/s as a fraction of the dense twin's in the same mode, compiled over
eager per model, and the planner's check of the run (log.plan_check, on a GPU with a preset):
measured over predicted step time and peak memory.

--quick: a toy width (d_model 128, 2 blocks, 8 experts top-2, 128-token sequences) and 3
steps, on whatever device there is: it checks that the bench runs (a smoke test does).
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import load_config  # noqa: E402
from trainer.run import run  # noqa: E402

MOE = ["model.d_model=2048", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=4",
       "model.head_dim=128", "model.qk_norm=true", "model.activation=swiglu",
       "model.max_seq_len=2048", "model.tie_embeddings=false",
       "moe.num_experts=64", "moe.top_k=8", "moe.d_ff=768", "moe.every=1",
       "data.seq_len=2048", "train.batch_size=16", "train.micro_batch_size=8"]
DENSE_TWIN = ["moe.every=0", "model.d_ff=6144"]  # 8 experts' worth of FFN per token
QUICK = ["model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=32", "model.qk_norm=true", "model.activation=swiglu",
         "moe.num_experts=8", "moe.top_k=2", "moe.d_ff=128", "moe.every=1",
         "data.seq_len=128", "train.batch_size=4", "train.micro_batch_size=2"]
QUICK_TWIN = ["moe.every=0", "model.d_ff=256"]
QUIET = ["train.eval_every=0", "checkpoint.every=0", "checkpoint.at_end=false",
         "log.moe_stats_every=0", "log.progress=none"]  # log.plan_check: auto (on a GPU preset)


def one_run(overrides: list, steps: int, warmup: int, device: str, out: Path) -> dict:
    """Train `steps` steps as train.py would; medians of the steps after `warmup`."""
    cfg = load_config(None, overrides + QUIET + [f"train.steps={steps}", f"run.device={device}",
                                                 f"run.dir={out}", "train.warmup_steps=1"])
    torch._dynamo.reset()  # each run compiles afresh, as its own train.py process would
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    code = run(cfg)
    if code != 0:
        raise SystemExit(f"train.py run {out.name} exited {code}")
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if "tokens_per_s" in r and r["step"] > warmup]
    med = {k: statistics.median(r[k] for r in timed) if all(k in r for r in timed) else None
           for k in ("tokens_per_s", "tflops", "mfu")}
    med["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None
    med["loss"] = timed[-1]["loss"]
    check = out / "planner_check.json"   # log.plan_check=auto: the planner's own prediction
    pc = json.loads(check.read_text()) if check.exists() else {}
    med["plan_step"] = pc.get("step_measured_over_predicted")
    med["plan_peak"] = pc.get("peak_measured_over_predicted")
    return med


def _fmt(v, spec: str) -> str:
    """v in `spec` ("8.1f"), or a dash of the same width where there is no figure."""
    return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    ap.add_argument("--quick", action="store_true", help="toy sizes, 3 steps: that it runs")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    args = ap.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    base, twin = (QUICK, QUICK_TWIN) if args.quick else (MOE, DENSE_TWIN)
    steps, warmup = (3, 1) if args.quick else (args.steps, args.warmup)
    modes = args.modes.split(",")
    print(f"device {device}; bf16; median of steps {warmup + 1}..{steps} of each train.py run")
    print(f"{'model':6s} {'mode':9s} {'tok/s':>10s} {'TFLOP/s':>8s} {'MFU %':>5s} {'peak GB':>8s} "
          f"{'loss':>7s} {'vs dense':>9s} {'vs eager':>9s} {'step m/p':>8s} {'peak m/p':>8s}")
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            for name, over in (("dense", base + twin), ("moe", base)):
                layout = ["parallel.precision=bf16", f"parallel.compile={str(mode == 'compiled').lower()}"]
                r = got[name, mode] = one_run(over + layout, steps, warmup, device,
                                              Path(tmp) / f"{name}-{mode}")
                vs_dense = r["tokens_per_s"] / got["dense", mode]["tokens_per_s"] if name == "moe" else None
                vs_eager = (r["tokens_per_s"] / got[name, "eager"]["tokens_per_s"]
                            if mode != "eager" and (name, "eager") in got else None)
                print(f"{name:6s} {mode:9s} {r['tokens_per_s']:10.0f} {_fmt(r['tflops'], '8.1f')} "
                      f"{_fmt(r['mfu'] and 100 * r['mfu'], '5.1f')} {_fmt(r['peak_gb'], '8.1f')} "
                      f"{r['loss']:7.3f} {_fmt(vs_dense, '9.2f')} {_fmt(vs_eager, '9.2f')} "
                      f"{_fmt(r['plan_step'], '8.2f')} {_fmt(r['plan_peak'], '8.2f')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
