"""Training-step time of parallel.precision=fp8 against bf16, timed in the same run.

    python bench/fp8.py [--steps 6] [--quick]

Two models: the default config (d_model 128), and a wide one (d_model 2048, d_ff 8192, 2
blocks, 8 experts of d_ff 2048, 512-token sequences) where GEMMs dominate the step, as they
must for FP8 to pay. Each is built, wrapped in the precision exactly as train.py applies it
(parallel/precision.py, parallel/fp8.py), initialised with one seed, and trained with AdamW
on the same random tokens; the median step time over --steps steps after one warm-up step
is printed for bf16 and fp8 with their ratio.

On a CPU every FP8 GEMM is an emulation (quantize, dequantize, fp32 GEMM: moe/fp8.py and
torchao's emulate mode), so the ratio there is the emulation's cost, not a speed-up: FP8's
speed is a GPU figure (torchao's float8 Linears call the FP8 tensor-core matmul on compute
capability >= 8.9; the expert banks' grouped FP8 kernel is not wired yet, so on a GPU the
banks still run the emulation and the ratio shows the Linears' gain net of it).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.build import init_weights  # noqa: E402
from parallel.fp8 import apply_fp8, fp8_matmul_available  # noqa: E402
from parallel.precision import apply_precision  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.planning import workload_from_config  # noqa: E402

WIDE = ["model.d_model=2048", "model.d_ff=8192", "model.n_layers=2", "model.n_heads=16",
        "moe.num_experts=8", "moe.d_ff=2048", "moe.every=2", "data.seq_len=512",
        "model.max_seq_len=512"]


def step_seconds(over: list, precision: str, steps: int, batch: int, device) -> float:
    cfg = load_config(None, over)
    model = workload_from_config(cfg).build_model()      # on meta: init_weights materialises it
    apply_precision(model, precision)
    if precision == "fp8":
        apply_fp8(model, "tensorwise")
    init_weights(model, 0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    S, V = cfg.data.seq_len, cfg.model.vocab_size
    times = []
    for i in range(steps + 1):
        ids = torch.randint(0, V, (batch, S + 1), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:                      # the first step warms up (allocator, torchao's caches)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per precision and model")
    ap.add_argument("--quick", action="store_true", help="the default config only, 2 steps")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    steps = 2 if args.quick else args.steps
    models = [("default config", [], 16)] + ([] if args.quick else [("wide (d_model 2048)", WIDE, 4)])
    kernels = "FP8 tensor-core matmuls for the Linears" if fp8_matmul_available(device) else \
        "emulated FP8 everywhere (no FP8 matmul on this device)"
    print(f"device {device.type}, {kernels}; median of {steps} steps after one warm-up")
    print(f"{'model':22s} {'bf16 s/step':>12s} {'fp8 s/step':>12s} {'fp8 / bf16':>11s}")
    for name, over, batch in models:
        bf16 = step_seconds(over, "bf16", steps, batch, device)
        fp8 = step_seconds(over, "fp8", steps, batch, device)
        print(f"{name:22s} {bf16:12.4f} {fp8:12.4f} {fp8 / bf16:11.2f}")
    if not fp8_matmul_available(device):
        print("on this device the ratio is the emulation's cost; FP8's speed-up is a GPU figure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
