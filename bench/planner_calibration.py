"""The planner against published MoE training runs: predicted vs published TFLOP/s per GPU.

    python bench/planner_calibration.py

Each run is checked with `python -m parallel.planner --layout` on the shipped config of its
model, the H100 preset (hardware.py, one set of constants, nothing tuned per run) and the
published layout, global batch and sequence length. Where the layout does not fit in 80 GB
as given, the planner's smallest fitting change (usually full recomputation) is shown too:
the published runs recompute selectively, which moekit does not model.

Sources (model TFLOP/s as each publisher counts them; every run is token-dropless):
  NeMo Megatron-Bridge performance summary, DGX-H100, 25.11 container
      (github.com/NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md): FP8 GEMMs
      (current scaling), experts force-balanced.
  DeepSeek-V3 technical report (arXiv 2412.19437): 2.664M H800 GPU-hours of pre-training
      for 14.8T tokens, PP16 (DualPipe) x EP64 x ZeRO-1 DP on 2048 GPUs, FP8 GEMMs; its
      TFLOP/s is derived here as 14.8T x (moekit's model FLOPs per token) / 2.664M h.
      H800 = H100 compute with 400 GB/s NVLink; the H100 preset is used as is.
"""
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from commands.plan import main as plan_main  # noqa: E402

# (run, config, world, layout, overrides, published TFLOP/s or None (derived), what differs)
RUNS = [
    ("Qwen3-30B-A3B, NeMo 25.11", "qwen3_30b_a3b", 16, "pp2 vp24 ep8 mbs2 z1",
     ["train.batch_size=512"], 121.0, "FP8-CS"),
    ("Qwen3-235B-A22B, NeMo 25.11", "qwen3_235b_a22b", 256, "tp2 pp8 vp4 ep32 mbs2 z1",
     ["train.batch_size=2048"], 233.0, "FP8-CS; published mbs 1 (moekit's tp MoE needs mbs % tp == 0)"),
    ("DeepSeek-V3, its report", "deepseek_v3", 2048, "pp16 ep64 z1 mbs1",
     [], None, "FP8, DualPipe, H800"),
    ("DeepSeek-V3, fp8 dispatch", "deepseek_v3", 2048, "pp16 ep64 z1 mbs1",
     ["moe.dispatch_dtype=fp8"], None, "as above; the dispatch in FP8 as DeepSeek's"),
    ("DeepSeek-V3, per-node dispatch", "deepseek_v3", 2048, "pp16 ep64 z1 mbs1",
     ["moe.dispatch_dtype=fp8", "moe.dispatch=hierarchical", "moe.max_nodes=4"], None,
     "as above; once per node, at most 4 nodes, as DeepSeek's"),
]
DEEPSEEK_TOKENS, DEEPSEEK_GPU_HOURS = 14.8e12, 2.664e6


def check(config: str, world: int, layout: str, overrides: list) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = plan_main(["--config", str(ROOT / "configs" / "models" / f"{config}.toml"), "--world",
                        str(world), "--hw", "h100", "--layout", layout, "--json", *overrides])
    if rc:
        raise SystemExit(f"{config}: the planner refused {layout!r}")
    return json.loads(out.getvalue())["layout"]


def derived_deepseek(pred: dict, world: int) -> float:
    """DeepSeek-V3's TFLOP/s per GPU from its GPU-hours: the planner's model FLOPs per token."""
    tokens_per_step = pred["tokens_per_s"] * pred["step_s"]
    flops_per_token = pred["tflops_per_gpu"] * 1e12 * pred["step_s"] * world / tokens_per_step
    return DEEPSEEK_TOKENS * flops_per_token / (DEEPSEEK_GPU_HOURS * 3600) / 1e12


def main() -> int:
    print(f"{'run':30s} {'GPUs':>5s}  {'layout':26s} {'published':>9s}  {'predicted (fits?)':>19s}"
          f"  {'smallest fitting change':>30s}  pred/pub")
    for name, config, world, layout, overrides, published, differs in RUNS:
        pred = check(config, world, layout, overrides)
        if published is None:
            published = derived_deepseek(pred, world)
        fit = pred["fits"]
        fixed = pred if fit else next(iter(pred["fixes"]), None)
        change = "-" if fit else (f"{fixed['change']}: {fixed['tflops_per_gpu']:.0f}" if fixed else "none found")
        best = fixed["tflops_per_gpu"] if fixed else pred["tflops_per_gpu"]
        print(f"{name:30s} {world:>5d}  {layout:26s} {published:>9.0f}  "
              f"{pred['tflops_per_gpu']:>13.0f} ({'yes' if fit else 'no'}) {change:>30s}"
              f"  {best / published:.2f}   [{differs}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
