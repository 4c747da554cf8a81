"""Training-step speed of parallel.precision=fp8 against bf16 through train.py's own code path,
in one process; and the expert banks' rowwise FP8 GEMMs against bf16 at the shapes where the
cost model decides.

    python bench/fp8.py [--steps 8] [--warmup 3] [--recipe rowwise] [--models wide,qwen3]
                        [--banks] [--quick]

Models: `wide` (d_model 2048, a dense FFN of d_ff 8192, 8 experts of d_ff 2048, 2 blocks,
512-token sequences: GEMMs dominate its step, as they must for FP8 to pay) and `qwen3` (the
Qwen3-30B-A3B-shaped MoE of bench/gpu_step.py: 8 blocks, 64 experts top-8 of d_ff 768).
Each (model, precision) is one train.py run (bench/gpu_step.py one_run) with
parallel.compile=auto (compiled on CUDA, eager on a CPU); printed are the median tokens/s of
the steps after --warmup, fp8's over bf16's, and, per GEMM shape (banks and Linears),
whether it ran FP8 on this device and the cost model's figures (parallel/fp8.py fp8_lines: a
shape that cannot gain stays bf16, moe/fp8_rowwise.py).

--banks (CUDA): one expert bank's forward and backward at four shapes, bf16 against rowwise
FP8 forced on every projection, and two Linears against torchao's rowwise Float8Linear, all
eager, with the cost model's verdict: the measurement behind the threshold.

--quick: the default config, 3 steps, on whatever device (a smoke test runs it). On a CPU
every FP8 GEMM is an emulation (quantize, dequantize, an fp32 GEMM), so the ratio there is
the emulation's cost, not a speed-up.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import MOE, one_run  # noqa: E402
from moe.experts import ExpertBank  # noqa: E402
from moe.fp8 import device_fp8_kernels  # noqa: E402
from moe.fp8_rowwise import rowwise_choice, rowwise_pays  # noqa: E402
from parallel.fp8 import apply_fp8, fp8_lines  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.model import build_model  # noqa: E402

WIDE = ["model.d_model=2048", "model.d_ff=8192", "model.n_layers=2", "model.n_heads=16",
        "moe.num_experts=8", "moe.d_ff=2048", "moe.every=2", "data.seq_len=512",
        "model.max_seq_len=512", "train.batch_size=8"]
MODELS = {"default": [], "wide": WIDE, "qwen3": MOE}
# (name, experts, d_model, d_ff, rows: tokens x top_k of one micro-batch)
BANKS = [("qwen3-30b experts", 64, 2048, 768, 16384 * 8), ("wide experts", 8, 2048, 2048, 4096 * 2),
         ("wide dense FFN", 1, 2048, 8192, 4096), ("mixtral-8x22b experts", 8, 6144, 16384, 32768 * 2)]
LINEARS = [("attention Linear", 2048, 2048, 16384), ("big Linear", 8192, 8192, 16384)]


def kernels_line(device: torch.device) -> str:
    k = device_fp8_kernels(device)
    return (f"Linears' FP8 matmuls {'real' if k.matmul else 'emulated'}, expert banks' rowwise "
            f"GEMMs {'real' if k.rowwise else 'emulated'}")


def gemm_lines(over: list, recipe: str, device: torch.device) -> list:
    """fp8_lines for the model a config describes, as train.py announces them (compiled on
    CUDA: parallel.compile=auto)."""
    cfg = load_config(None, over)
    model = build_model(cfg, torch.device("meta"))
    rows = (cfg.train.micro_batch_size or cfg.train.batch_size) * cfg.data.seq_len
    apply_fp8(model, recipe, rows=rows, compiled=device.type == "cuda")
    return fp8_lines(model, rows, device, device.type == "cuda")


def time_bank(E: int, D: int, F: int, rows: int, fp8: bool, reps: int = 3) -> float:
    """Seconds of one bank forward and backward under bf16 autocast, median of reps."""
    torch.manual_seed(0)
    bank = ExpertBank(E, D, F, "swiglu").cuda()
    if fp8:
        bank.set_fp8(True, "rowwise", where_it_pays=False)
    x = torch.randn(rows, D, device="cuda", requires_grad=True)
    gy = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((E,), rows // E, device="cuda", dtype=torch.long)
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            y = bank(x, counts)
        y.backward(gy)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        bank.zero_grad(set_to_none=True)
        x.grad = None
    del bank, x, gy
    torch.cuda.empty_cache()
    return statistics.median(times)


def time_linear(in_f: int, out_f: int, rows: int, fp8: bool, reps: int = 5) -> float:
    """Seconds of one Linear's forward and backward under bf16 autocast (torchao's rowwise
    Float8Linear where fp8), eager, median of reps."""
    import dataclasses

    from parallel.fp8 import _torchao_float8
    torch.manual_seed(0)
    m = torch.nn.Linear(in_f, out_f, bias=False).cuda()
    if fp8:
        Float8Linear, Config, _ = _torchao_float8(torch.device("cuda"))
        m = Float8Linear.from_float(m, config=dataclasses.replace(Config.from_recipe_name("rowwise")))
    x = torch.randn(rows, in_f, device="cuda", requires_grad=True)
    gy = torch.randn(rows, out_f, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            y = m(x)
        y.backward(gy)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def banks_table() -> None:
    print(f"\n{'bank (eager, fwd+bwd)':24s} {'shape':>22s} {'bf16 ms':>9s} {'fp8 ms':>9s} "
          f"{'fp8 speed':>9s}  cost model (per projection)")
    for name, E, D, F, rows in BANKS:
        bf16, fp8 = time_bank(E, D, F, rows, False), time_bank(E, D, F, rows, True)
        (up, down, _), _ = rowwise_choice(D, F, rows / E, True, compiled=False)
        verdict = f"w1/w3 {'pays' if up else 'stays bf16'}, w2 {'pays' if down else 'stays bf16'}"
        print(f"{name:24s} {f'{E} x {D} x {F}, {rows} rows':>22s} {bf16 * 1e3:9.2f} {fp8 * 1e3:9.2f} "
              f"{bf16 / fp8:9.2f}  {verdict}", flush=True)
    for name, in_f, out_f, rows in LINEARS:
        bf16, fp8 = time_linear(in_f, out_f, rows, False), time_linear(in_f, out_f, rows, True)
        ok = rowwise_pays(in_f, out_f, rows, compiled=False)[0]
        print(f"{name:24s} {f'{in_f} x {out_f}, {rows} rows':>22s} {bf16 * 1e3:9.2f} {fp8 * 1e3:9.2f} "
              f"{bf16 / fp8:9.2f}  {'pays' if ok else 'stays bf16'} (torchao rowwise Float8Linear)",
              flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--recipe", default="rowwise", help="parallel.fp8_recipe (default rowwise)")
    ap.add_argument("--models", default="wide,qwen3", help="of default, wide, qwen3")
    ap.add_argument("--banks", action="store_true", help="also time single banks (CUDA)")
    ap.add_argument("--quick", action="store_true", help="the default config, 3 steps")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = ["default"] if args.quick else args.models.split(",")
    steps, warmup = (3, 1) if args.quick else (args.steps, args.warmup)
    print(f"device {device.type}, fp8_recipe={args.recipe}: {kernels_line(device)}; median of "
          f"steps {warmup + 1}..{steps} of each train.py run")
    print(f"{'model':10s} {'bf16 tok/s':>11s} {'fp8 tok/s':>11s} {'fp8 speed':>9s}")
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            over = MODELS[name]
            got = {}
            for prec in ("bf16", "fp8"):
                extra = [f"parallel.precision={prec}"] + \
                    ([f"parallel.fp8_recipe={args.recipe}"] if prec == "fp8" else [])
                got[prec] = one_run(over + extra, steps, warmup, device.type,
                                    Path(tmp) / f"{name}-{prec}")["tokens_per_s"]
            print(f"{name:10s} {got['bf16']:11.0f} {got['fp8']:11.0f} {got['fp8'] / got['bf16']:9.2f}",
                  flush=True)
            notes += [f"  {name}: {ln}" for ln in gemm_lines(over, args.recipe, device)]
    for ln in notes:
        print(ln)
    if args.banks and device.type == "cuda":
        banks_table()
    if not device_fp8_kernels(device).matmul:
        print("on this device the ratio is the emulation's cost; FP8's speed-up is a GPU figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
