"""The planner against published MoE training runs: predicted vs published tokens/s per GPU.

    python bench/planner_calibration.py [--best]

--best also runs the planner's search for each model on its first row's GPUs and features
and prints the layout it ranks first beside the published one, with the parts of the step
that make the difference (issue 61: a claim to check on a cluster, not a measurement).

Each run is predicted by `python -m parallel.planner --layout` on the shipped config of its
model, compiled (parallel.compile=true: the published runs' fused kernels, Transformer Engine's
or DeepSeek's, are nearest moekit's compiled blocks), the H100 preset (H800 for DeepSeek-V3; hardware.py: one set of constants per preset,
nothing fitted to these runs), the published layout, global batch and sequence length, and
its features encoded as
overrides (precision, dispatch, overlap, recomputation; the Megatron runs' gates applied inside
the experts, moe.gates_in_experts, as Megatron-Core does). Every row is read at the
prediction (`step_s`: what the configured all-to-all overlap hides is taken off,
parallel/planner/step_time.py), with and without the overlap alike; the bound with every
overlappable collective hidden (`step_s_min`) is printed beside it. Published TFLOP/s are turned
into tokens/s per GPU with the planner's own FLOPs per token in the same convention as the
publishers' (Megatron-LM: causal attention counted half; parallel/planner/flops.py), so the
ratio compares throughput, not FLOP conventions.

Runs (`published` in TFLOP/s per GPU, or tokens/s per GPU where marked):
  Qwen3-30B-A3B, 16 H100, bf16, EP16, MBS1, GBS 1024, seq 4096: 244 with the expert
      all-to-all overlap off, 287 with it on (Megatron-Bridge's expert-parallel overlap
      notes; 0.11% -> 36.55% of the communication time hidden).
  Qwen3-235B-A22B, 256 H100, bf16, TP2 PP8 VP4 EP32, MBS1, GBS 2048, seq 4096, recomputing
      the norms and the activations: 245, 276 with the 1F1B all-to-all overlap
      (Megatron-MoE-ModelZoo's Qwen3 best practice); recompute_modules=layernorm,moe_act as
      published (under tp the attention's input is kept as the norm's input and gathered
      again in backward, parallel/output_recompute.py).
  Qwen3-30B-A3B, 16 H100, FP8 (current scaling), PP2 VP24 EP8, MBS2, GBS 512: 121; and
  Qwen3-235B-A22B, 256 H100, FP8, TP2 PP8 VP4 EP32, MBS1, GBS 2048: 233 (NeMo Megatron-
      Bridge's performance summary, 25.11 container, experts force-balanced).
  The same two layouts in the 25.09 container's summary (token-drop with forced balance: the
      shapes of dropless): 241 and 178 -- one publisher's two releases 2.0x and 0.76x apart
      on one layout, the spread of published figures.
  Qwen3-30B-A3B, 16 H100, bf16, EP16, the alltoall dispatcher without TE's fused permutation
      or CUDA graphs: a step of 41.25 s, 31.31 s with the overlap (Megatron-Bridge's overlap
      notes, a "directional" 6-step smoke).
  Qwen3-235B-A22B on the same 256 H100 in three more layouts (Megatron-MoE-ModelZoo's table
      beside the cross-node one above, bf16, GBS 2048): TP2 EP8 FSDP MBS4 recomputing whole
      layers, DeepEP, 17.6 s a step; TP2 PP32 VP3 EP8 MBS1 norms and activations, alltoall,
      24.2 s; TP4 PP8 VP4 EP8 MBS1 no recomputation, DeepEP, 29.0 s. With the cross-node row
      (19.7 s) they are a layout order: the Spearman correlation of predicted and published
      throughput over the four is printed.
  DeepSeek-V3, 2048 H800, PP16 (DualPipe) EP64 ZeRO-1, FP8 GEMMs: 2.664M GPU-hours for 14.8T
      tokens (its report) = 1543 tokens/s per GPU. Encoded: dualpipev with the 1F1B overlap,
      the dispatch in fp8, once per node to at most 4 nodes, recomputing MLA's
      up-projections and the norms, FP8 GEMMs (parallel.precision=fp8), on the h800 preset
      (the H100's compute, NVLink 400 GB/s total).
"""
import contextlib
import io
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from commands.plan import main as plan_main  # noqa: E402

BF16 = ["parallel.precision=bf16", "parallel.compile=true"]
# Megatron's bf16 parameters with fp32 master copies in the distributed optimizer (or its
# FSDP): moekit's param_dtype=bf16 (fp32 masters in the ZeRO-1/2 slices, FSDP2's fp32 shards
# under ZeRO-3); refused under tp with ZeRO-1/2 (not implemented there)
BF16_PARAMS = ["parallel.param_dtype=bf16"]
FP8 = ["parallel.precision=fp8", "parallel.compile=true"]
OVERLAP = ["parallel.a2a_overlap=1f1b"]
# Megatron-Core applies the router probabilities inside the experts' activation (its
# TEGroupedMLP's weighted SwiGLU; its unpermute takes no probabilities): moe.gates_in_experts
MEGATRON = ["moe.gates_in_experts=true"]
# DeepEP's and HybridEP's dispatch sends a token once to each node holding its experts and
# forwards it inside the node over NVLink: moe.dispatch=hierarchical (moe/hierarchical.py)
DEEPEP = ["moe.dispatch=hierarchical"]
BALANCED = ["moe.force_balance=true"]   # the publisher forced balanced routing
HW = "--hw="   # a run's preset, among its overrides (default h100)
_ZOO = 2048 * 4096 / 256   # Megatron-MoE-ModelZoo's Qwen3-235B steps: tokens per GPU a step
# (run, config, world, layout, overrides, published, unit, what differs from the published run)
RUNS = [
    ("Qwen3-30B-A3B, a2a overlap off", "qwen3_30b_a3b", 16, "dp16 ep16 z1",
     BF16 + BF16_PARAMS + MEGATRON + DEEPEP + BALANCED
     + ["train.batch_size=1024", "train.micro_batch_size=1"], 244.0, "TFLOP/s", ""),
    ("Qwen3-30B-A3B, a2a overlap on", "qwen3_30b_a3b", 16, "dp16 ep16 z1",
     BF16 + BF16_PARAMS + MEGATRON + DEEPEP + BALANCED + OVERLAP
     + ["train.batch_size=1024", "train.micro_batch_size=1"], 287.0, "TFLOP/s", ""),
    ("Qwen3-235B-A22B, overlap off", "qwen3_235b_a22b", 256, "tp2 pp8 vp4 ep32 mbs1 z1 rc=layernorm+moe_act",
     BF16 + MEGATRON + DEEPEP + ["train.batch_size=2048"], 245.0, "TFLOP/s", ""),
    ("Qwen3-235B-A22B, overlap on", "qwen3_235b_a22b", 256, "tp2 pp8 vp4 ep32 mbs1 z1 rc=layernorm+moe_act",
     BF16 + MEGATRON + DEEPEP + OVERLAP + ["train.batch_size=2048"], 276.0, "TFLOP/s", ""),
    # NeMo Megatron-Bridge's performance summary (DGX-H100, 25.11 container): FP8 GEMMs with
    # current scaling, experts force-balanced; kept from the table's first version
    # the overlap as moekit can run it under this interleaved pipeline: chunked (d = 2)
    ("Qwen3-235B-A22B, overlap on, chunks", "qwen3_235b_a22b", 256,
     "tp2 pp8 vp4 ep32 mbs1 z1 rc=layernorm+moe_act",
     BF16 + MEGATRON + ["train.batch_size=2048", "moe.a2a_overlap_degree=2"],
     276.0, "TFLOP/s", "chunked overlap, flat dispatch"),
    ("Qwen3-30B-A3B, NeMo 25.11 FP8", "qwen3_30b_a3b", 16, "pp2 vp24 ep8 mbs2 z1",
     FP8 + MEGATRON + ["train.batch_size=512", "moe.force_balance=true"], 121.0, "TFLOP/s", ""),
    ("Qwen3-235B-A22B, NeMo 25.11 FP8", "qwen3_235b_a22b", 256, "tp2 pp8 vp4 ep32 mbs1 z1",
     FP8 + MEGATRON + ["train.batch_size=2048", "moe.force_balance=true"], 233.0, "TFLOP/s", ""),
    ("Qwen3-30B-A3B, NeMo 25.09", "qwen3_30b_a3b", 16, "pp2 vp24 ep8 mbs2 z1",
     FP8 + MEGATRON + ["train.batch_size=512", "moe.force_balance=true"], 241.0, "TFLOP/s", ""),
    ("Qwen3-235B-A22B, NeMo 25.09", "qwen3_235b_a22b", 256, "tp2 pp8 vp4 ep32 mbs1 z1",
     FP8 + MEGATRON + ["train.batch_size=2048", "moe.force_balance=true"], 178.0, "TFLOP/s", ""),
    ("Qwen3-30B-A3B, alltoall, overlap off", "qwen3_30b_a3b", 16, "dp16 ep16 z1",
     BF16 + BF16_PARAMS + MEGATRON + ["train.batch_size=1024", "train.micro_batch_size=1"],
     1024 * 4096 / 16 / 41.25, "tokens/s", "TE's fused permutation off in the run"),
    ("Qwen3-30B-A3B, alltoall, overlap on", "qwen3_30b_a3b", 16, "dp16 ep16 z1",
     BF16 + BF16_PARAMS + MEGATRON + OVERLAP + ["train.batch_size=1024", "train.micro_batch_size=1"],
     1024 * 4096 / 16 / 31.31, "tokens/s", "TE's fused permutation off in the run"),
    ("Qwen3-235B-A22B, EP8 FSDP", "qwen3_235b_a22b", 256, "dp128 tp2 ep8 mbs4 z3 rc",
     BF16 + BF16_PARAMS + MEGATRON + DEEPEP + ["train.batch_size=2048"], _ZOO / 17.6, "tokens/s",
     ""),
    ("Qwen3-235B-A22B, PP32 alltoall", "qwen3_235b_a22b", 256, "tp2 pp32 vp3 ep8 mbs1 z1 rc=layernorm+moe_act",
     BF16 + MEGATRON + ["train.batch_size=2048"], _ZOO / 24.2, "tokens/s", ""),
    ("Qwen3-235B-A22B, TP4 PP8 EP8", "qwen3_235b_a22b", 256, "tp4 pp8 vp4 ep8 mbs1 z1",
     BF16 + MEGATRON + DEEPEP + ["train.batch_size=2048"], _ZOO / 29.0, "tokens/s", ""),
    ("DeepSeek-V3, its report", "deepseek_v3", 2048, "pp16 ep64 z1 mbs1 dualpipev rc=mla_up_proj+layernorm",
     FP8 + OVERLAP + ["moe.dispatch_dtype=fp8", "moe.dispatch=hierarchical",
                                             "moe.max_nodes=4", HW + "h800"],
     14.8e12 / (2.664e6 * 3600), "tokens/s", ""),
]

# Published peak memory (GB = 1e9 bytes) where the publisher gives one for the row's layout:
# Megatron-Bridge's Qwen3-30B-A3B 16 x H100 EP16 MBS1 seq 4096 bf16 recipe, "rank-0 peak
# allocated memory: 62.166 GiB" (HybridEP; skills/nemo-mbridge-perf-moe-hardware-configs), and
# 61.351 GB with the alltoall dispatcher (docs/training/moe-optimization.md, a 5-step smoke run)
# one model, one cluster, several layouts: their published order against the predicted one
ORDER = ("Qwen3-235B-A22B, overlap off", "Qwen3-235B-A22B, EP8 FSDP",
         "Qwen3-235B-A22B, PP32 alltoall", "Qwen3-235B-A22B, TP4 PP8 EP8")
PUBLISHED_PEAK_GB = {"Qwen3-30B-A3B, a2a overlap off": 61.351,
                     "Qwen3-30B-A3B, a2a overlap on": 62.166 * 2 ** 30 / 1e9}


def spearman(xs: list, ys: list) -> float:
    """Spearman's rank correlation (no ties)."""
    def ranks(v):
        return [sorted(v).index(x) for x in v]
    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def check(config: str, world: int, layout: str, overrides: list) -> dict:
    hw = next((o[len(HW):] for o in overrides if o.startswith(HW)), "h100")
    overrides = [o for o in overrides if not o.startswith(HW)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = plan_main(["--config", str(ROOT / "configs" / "models" / f"{config}.toml"), "--world",
                        str(world), "--hw", hw, "--layout", layout, "--json", *overrides])
    if rc:  # a layout moekit refuses: the row stays, with the reason
        return {"refused": (err.getvalue() + out.getvalue()).strip().splitlines()[-1]}
    return json.loads(out.getvalue())["layout"]


def search_best(config: str, world: int, overrides: list):
    """The planner's own best layout (its search, --json) for a row's model, GPUs and
    features; None when nothing fits."""
    hw = next((o[len(HW):] for o in overrides if o.startswith(HW)), "h100")
    overrides = [o for o in overrides if not o.startswith(HW)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = plan_main(["--config", str(ROOT / "configs" / "models" / f"{config}.toml"), "--world",
                        str(world), "--hw", hw, "--json", *overrides])
    fits = json.loads(out.getvalue())["fits"] if rc == 0 else []
    return fits[0] if fits else None


def _slowest(pred: dict) -> dict:
    return max(pred["ranks"], key=lambda r: r["step_s"])["breakdown_s"]


def print_best(rows: list) -> None:
    """Per model (its first row's GPUs and features): the search's best layout beside the
    published one, tokens/s per GPU both predicted, and the parts of the slowest stage's
    step that differ most (negative: the best layout spends less there)."""
    print("the planner's own best layout beside the published one (predicted tokens/s per GPU;"
          " the slowest stage's parts that differ most, best - published, s):")
    seen = set()
    for name, config, world, layout, overrides, pred in rows:
        model = name.split(",")[0]
        if model in seen:
            continue
        seen.add(model)
        best = search_best(config, world, overrides)
        if best is None:
            print(f"  {model}: the search finds no layout that fits")
            continue
        mine, theirs = _slowest(best), _slowest(pred)
        diff = sorted(((mine.get(k, 0.0) - theirs.get(k, 0.0), k) for k in set(mine) | set(theirs)),
                      key=lambda d: -abs(d[0]))
        got, pub = best["tokens_per_s_per_gpu"], pred["tokens_per_s"] / world
        print(f"  {model}: {best['name']} {got:.0f} vs {layout} {pub:.0f} ({got / pub:.2f}x): "
              + ", ".join(f"{k} {d:+.2f}" for d, k in diff[:3]))


def main() -> int:
    warnings.filterwarnings("ignore", message=r"MoELayer\(force_balance=True\)")  # the NeMo runs'
    print(f"{'run':36s} {'GPUs':>5s}  {'layout':44s} {'published':>10s} {'predicted':>10s}  "
          f"pred/pub  {'bound':>6s}  fits (peak GB)  differs")
    gains, parts, rows, ratios, order = {}, [], [], {}, {}
    for name, config, world, layout, overrides, published, unit, differs in RUNS:
        pred = check(config, world, layout, overrides)
        if "refused" in pred:
            print(f"{name:36s} {world:>5d}  {layout:44s} {'':>10s} {'refused':>10s}  {pred['refused']}")
            continue
        got = pred["tokens_per_s"] / world   # at the prediction, step_s
        bound = got * pred["step_s"] / pred["step_s_min"]
        pub = published * 1e12 / pred["flops_per_token"] if unit == "TFLOP/s" else published
        print(f"{name:36s} {world:>5d}  {layout:44s} {pub:>10.0f} {got:>10.0f}  {got / pub:8.2f}"
              f"  {bound / pub:6.2f}  {'yes' if pred['fits'] else 'no':>4s} ({pred['peak_bytes'] / 1e9:6.1f})"
              f"  {differs}")
        parts.append((name, pred))
        ratios[name] = got / pub
        if name in ORDER:
            order[name] = (got, pub)
        rows.append((name, config, world, layout, overrides, pred))
        if "overlap o" in name:  # the pairs measured with and without the overlap
            gains.setdefault(name.rsplit("overlap", 1)[0].rstrip(", "), {})["overlap on" in name] = (got, pub)
    print("tokens/s per GPU; the overlap's gain (on / off - 1), predicted vs published:")
    for model, g in gains.items():
        if len(g) == 2:
            pred_gain, pub_gain = g[True][0] / g[False][0] - 1, g[True][1] / g[False][1] - 1
            print(f"  {model}: predicted {pred_gain:+.1%}, published {pub_gain:+.1%}")
    errors = sorted(abs(r - 1) for r in ratios.values())
    worst = max(ratios, key=lambda n: abs(ratios[n] - 1))
    print(f"error |pred/pub - 1| over the {len(errors)} rows predicted: median "
          f"{errors[len(errors) // 2]:.0%}, worst {errors[-1]:.0%} ({worst})")
    if len(order) == len(ORDER):
        got, pub = zip(*order.values())
        print(f"layout order over {', '.join(n.split(', ')[1] for n in order)}: Spearman "
              f"{spearman(list(got), list(pub)):+.2f} (published fastest first: "
              + ", ".join(n.split(", ")[1] for n in sorted(order, key=lambda n: -order[n][1])) + ")")
    print("peak memory, predicted vs published (GB), where the publisher gives one:")
    for name, pred in parts:
        if name in PUBLISHED_PEAK_GB:
            pub = PUBLISHED_PEAK_GB[name]
            print(f"  {name}: {pred['peak_bytes'] / 1e9:.1f} vs {pub:.1f} ({pred['peak_bytes'] / 1e9 / pub:.2f}x)")
    print("the slowest stage's predicted step by part, % (parts of 3% or more; the first weighs most):")
    for name, pred in parts:
        stage = max(pred["ranks"], key=lambda r: r["step_s"])
        shares = sorted(((v / stage["step_s"], k) for k, v in stage["breakdown_s"].items()),
                        key=lambda kv: -abs(kv[0]))
        print(f"  {name}: " + ", ".join(f"{k} {f:.0%}" for f, k in shares if abs(f) >= 0.03))
    if "--best" in sys.argv[1:]:
        print_best(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
