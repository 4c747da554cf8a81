"""Achievable bf16 matmul throughput against the data-sheet peak: the evidence behind the
planner's GEMM_EFFICIENCY (parallel/planner/hardware.py).

    python bench/gemm_efficiency.py            (on a GPU; on a CPU it says so and exits 0)

Times torch.matmul in bf16 with CUDA events (warm-up, then the median of 20 launches) for a
square 8192^3 product and the shapes of one MoE step's matmuls (tokens x d_model x d_ff of
Mixtral-8x7B and DeepSeek-V3 experts), and prints TFLOP/s and the fraction of the preset's
dense bf16 peak for the GPU it recognises (H100/H200/A100/B200/MI300X by name).
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parallel.planner.hardware import DATA_SHEETS, GEMM_EFFICIENCY  # noqa: E402

SHAPES = [("square 8192", 8192, 8192, 8192),
          ("mixtral expert up  (T=8192, D=4096 -> F=14336)", 8192, 4096, 14336),
          ("mixtral expert down (T=8192, F=14336 -> D=4096)", 8192, 14336, 4096),
          ("deepseek expert up  (T=4096, D=7168 -> F=2048)", 4096, 7168, 2048),
          ("attention qkv (T=16384, D=4096 -> 3D)", 16384, 4096, 12288)]


def tflops(m, k, n, reps=20) -> float:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * m * k * n / statistics.median(times) / 1e12


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this bench measures a GPU's matmul throughput; nothing to do")
        return 0
    name = torch.cuda.get_device_name()
    key = next((k for k in DATA_SHEETS if k in name.lower().replace(" ", "")), None)
    peak = DATA_SHEETS[key][0] if key else None
    print(f"{name}: data-sheet dense bf16 peak {peak or 'unknown'} TFLOP/s; planner assumes "
          f"{GEMM_EFFICIENCY:.0%} of it")
    for label, m, k, n in SHAPES:
        t = tflops(m, k, n)
        print(f"  {label:<50} {t:7.1f} TFLOP/s" + (f"  {t / peak:5.1%} of peak" if peak else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
