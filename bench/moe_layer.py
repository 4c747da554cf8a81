"""Benchmark: forward+backward of moe.MoELayer against a floor and two peer implementations.

Shapes: T tokens, D model dim, F ffn dim, E experts, K top-k, N = T*K routed rows.
Every contender runs in this process on the same machine state, and is reported as the
median of several timed repetitions after warm-up, plus its ratio to the floor:

  floor      the same routed FLOPs as perfectly balanced grouped dense matmuls
             (torch.bmm over [E, N/E, D]) with the same activation and no routing at all
  moekit     moe.MoELayer, dropless, default experts_impl="auto" (the path it picks is printed)
  loop       moe.MoELayer(experts_impl="loop"): per-expert fused loop (also in the E sweep)
  grouped_mm moe.MoELayer(experts_impl="grouped_mm"): one torch._grouped_mm per projection
  balanced   moe.MoELayer(force_balance=True): the default path with exactly balanced
             assignments -- the ceiling routing balance alone could reach
  hf         transformers' MixtralSparseMoeBlock (swiglu), built from a small config
  fairscale  fairscale MOELayer + Top2Gate (k=2, fp32 only; world-1 process group)

Each moekit row is followed by its op census (moe/profiling/census.py: aten ops, host syncs and
non-GEMM bytes of one forward+backward, as a multiple of the input's bytes). The "fine"
section runs the fine-grained shape D=2048, E=64, k=8, F=768, T=16384 (Qwen3-30B-A3B's
experts; T=512 on a CPU, where bf16 GEMMs may be slow), swiglu, each dtype.

Run:  python bench/moe_layer.py            (full: T=8192, D=512, F=2048, ~15-30 min on 2 cores)
      python bench/moe_layer.py --quick    (smoke run on a toy size, seconds)
Timings are wall-clock on a shared CPU: read ratios measured in the same run, not absolutes.
"""
import argparse
import functools
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe import MoELayer  # noqa: E402
from moe.profiling.census import OpCensus  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_medians(steps: dict, reps: int, warmup: int) -> dict:
    """Median wall time per step, timing all steps round-robin (order rotated each round).

    Interleaving means a change in the machine's load (other jobs on the shared cores) hits
    every contender alike, so ratios measured in one call stay meaningful.
    """
    names = list(steps)
    for _ in range(warmup):
        for n in names:
            steps[n]()
    sync()
    times = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            steps[n]()
            sync()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def fwd_bwd_step(module, x, grad_y):
    """One forward+backward; gradients are dropped (set_to_none) so nothing accumulates."""
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        y = module(x)
        y.backward(grad_y)
    return step


class Floor(torch.nn.Module):
    """Perfectly balanced experts: [E, N/E, D] rows through bmm FFNs, no routing."""

    def __init__(self, E, D, F_, act, dtype):
        super().__init__()
        gated = act == "swiglu"
        mk = lambda *s: torch.nn.Parameter(torch.randn(*s, dtype=dtype) * 0.02)  # noqa: E731
        self.w1, self.w2 = mk(E, D, F_), mk(E, F_, D)
        self.w3 = mk(E, D, F_) if gated else None
        self.act = F.silu if gated else F.gelu

    def forward(self, x_END):
        h = self.act(torch.bmm(x_END, self.w1))
        if self.w3 is not None:
            h = h * torch.bmm(x_END, self.w3)
        return torch.bmm(h, self.w2)


def floor_case(T, D, F_, E, K, act, dtype, dev):
    if (T * K) % E:
        raise ValueError(f"T*K={T * K} must be divisible by E={E} for a balanced floor")
    mod = Floor(E, D, F_, act, dtype).to(dev)
    x = torch.randn(E, T * K // E, D, dtype=dtype, device=dev, requires_grad=True)
    return mod, x


def ours_case(T, D, F_, E, K, act, dtype, dev, experts_impl="auto", force_balance=False):
    with warnings.catch_warnings():  # force_balance warns; the row name says it already
        warnings.simplefilter("ignore")
        mod = MoELayer(D, F_, E, K, None, act, experts_impl=experts_impl,
                       force_balance=force_balance).to(device=dev, dtype=dtype)
    x = torch.randn(T, D, dtype=dtype, device=dev, requires_grad=True)
    return mod, x


def hf_case(T, D, F_, E, K, act, dtype, dev):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    import transformers
    transformers.logging.set_verbosity_error()  # standalone block: silence the interface note
    cfg = MixtralConfig(hidden_size=D, intermediate_size=F_, num_local_experts=E,
                        num_experts_per_tok=K)
    mod = MixtralSparseMoeBlock(cfg)
    for p in mod.parameters():  # the block leaves its weights uninitialised (torch.empty)
        torch.nn.init.normal_(p, std=0.02)
    mod = mod.to(device=dev, dtype=dtype)
    x = torch.randn(1, T, D, dtype=dtype, device=dev, requires_grad=True)
    return mod, x


def fairscale_case(T, D, F_, E, K, act, dtype, dev):
    import torch.distributed as dist
    from fairscale.nn import MOELayer, Top2Gate
    if K != 2 or dtype != torch.float32:
        raise ValueError("fairscale Top2Gate is k=2 and fp32 only")
    if not dist.is_initialized():  # world of one, only so MOELayer has a group
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = dist.HashStore()  # in-process rendezvous: no port, no file
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    gelu_or_silu = torch.nn.GELU() if act == "gelu" else torch.nn.SiLU()
    experts = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(D, F_, bias=False), gelu_or_silu,
                            torch.nn.Linear(F_, D, bias=False)) for _ in range(E))
    mod = MOELayer(Top2Gate(D, E), experts).to(dev)
    # MOELayer wants the leading dim divisible by the local expert count
    x = torch.randn(E, T // E, D, device=dev, requires_grad=True)
    return mod, x


CASES = {"floor": floor_case, "moekit": ours_case,
         "loop": functools.partial(ours_case, experts_impl="loop"),
         "grouped_mm": functools.partial(ours_case, experts_impl="grouped_mm"),
         "balanced": functools.partial(ours_case, force_balance=True),
         "hf": hf_case, "fairscale": fairscale_case}


def auto_impl(D, F_, dtype) -> str:
    """The expert path experts_impl="auto" takes for this device, dtype and size."""
    from moe.grouped_mm import resolve_impl
    return resolve_impl("auto", device(), dtype, D, F_)


def build_step(name, T, D, F_, E, K, act, dtype):
    mod, x = CASES[name](T, D, F_, E, K, act, dtype, device())
    with torch.no_grad():
        grad_y = torch.randn_like(mod(x))
    return fwd_bwd_step(mod, x, grad_y)


def run_config(T, D, F_, E, K, act, dtype_name, peers, reps, warmup):
    """Floor, moekit and peers for one config, interleaved; prints one line each."""
    dtype = DTYPES[dtype_name]
    other = "loop" if auto_impl(D, F_, dtype) == "grouped_mm" else "grouped_mm"
    names = ["floor", "moekit", other, "balanced"] + peers
    med = interleaved_medians({n: build_step(n, T, D, F_, E, K, act, dtype) for n in names},
                              reps, warmup)
    label = f"T={T} E={E} k={K} {act} {dtype_name}"
    print(f"{label:34s} (moekit = experts_impl='auto' -> {auto_impl(D, F_, dtype)!r})", flush=True)
    for n in names:
        print(f"{label:34s} {n:10s} {med[n] * 1e3:9.1f} ms  {med[n] / med['floor']:6.2f}x floor",
              flush=True)
    print(f"{label:34s} census     {census_line(T, D, F_, E, K, act, dtype)}", flush=True)
    return med


def census_line(T, D, F_, E, K, act, dtype) -> str:
    """The op census of one forward+backward of the moekit row's layer (after a warm-up)."""
    mod, x = ours_case(T, D, F_, E, K, act, dtype, device())
    with torch.no_grad():
        step = fwd_bwd_step(mod, x, torch.randn_like(mod(x)))
    step()
    with OpCensus() as census:
        step()
    got = census.summary(x.numel() * x.element_size())
    return (f"{got['ops']} ops, {got['syncs']} host syncs {got['sync_ops'] or ''}, "
            f"{got['bytes_x']}x the input's bytes outside GEMMs")


def sweep_steps(T, D, F_, E, K):
    """floor, loop and grouped_mm steps for one E that share one set of expert weights (at
    E=256, D=512, F=2048 a set is 2 GB, and its gradient as much again)."""
    layer = MoELayer(D, F_, E, K, None, "gelu")
    floor = Floor(E, 1, 1, "gelu", torch.float32)
    floor.w1, floor.w2 = layer.experts.w1, layer.experts.w2
    x_TD = torch.randn(T, D, requires_grad=True)
    x_END = torch.randn(E, T * K // E, D, requires_grad=True)
    gy_TD, gy_END = torch.randn_like(x_TD), torch.randn_like(x_END)

    def with_impl(impl):
        step = fwd_bwd_step(layer, x_TD, gy_TD)

        def run():
            layer.experts.experts_impl = impl
            step()
        return run
    return {"floor": fwd_bwd_step(floor, x_END, gy_END), "loop": with_impl("loop"),
            "grouped_mm": with_impl("grouped_mm")}


def run_sweep(T, D, F_, experts, reps, warmup):
    """Per E: floor, loop and grouped_mm timed in the same rounds (k=2 gelu fp32); one E at
    a time, so ratios to the floor are same-round, times across E are not."""
    names = ("floor", "loop", "grouped_mm")
    print(f"\nE sweep, T={T} k=2 gelu fp32: ms (relative to E={experts[0]}), ratio to the floor",
          flush=True)
    med = {}
    for E in experts:
        m = interleaved_medians(sweep_steps(T, D, F_, E, 2), reps, warmup)
        med.update({(n, E): m[n] for n in names})
        f, lp, g = (m[n] for n in names)
        rel = {n: med[(n, E)] / med[(n, experts[0])] for n in names}
        print(f"E={E:4d}  floor {f * 1e3:8.1f} ({rel['floor']:.2f}x)   "
              f"loop {lp * 1e3:8.1f} ({rel['loop']:.2f}x) {lp / f:.2f}x floor   "
              f"grouped_mm {g * 1e3:8.1f} ({rel['grouped_mm']:.2f}x) {g / f:.2f}x floor",
              flush=True)
    return med


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="toy sizes and few reps (smoke run)")
    ap.add_argument("--tokens", type=int, default=None, help="T (default 8192, quick 256)")
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--d-ff", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (median taken)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--sweep-tokens", type=int, default=None, help="T of the E sweep (default: T)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of dtypes of the main rows")
    ap.add_argument("--ks", default="2,1", help="comma list of top-k values of the main rows")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: main,fine,sweep,peers")
    args = ap.parse_args(argv)
    q = args.quick
    T = args.tokens or (256 if q else 8192)
    D = args.d_model or (32 if q else 512)
    F_ = args.d_ff or (64 if q else 2048)
    reps = args.reps or (2 if q else 5)
    warmup = args.warmup if args.warmup is not None else (1 if q else 2)
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, device {device()}, threads {torch.get_num_threads()}, "
          f"D={D} F={F_}, median of {reps} after {warmup} warm-up", flush=True)

    peers_on = "peers" not in skip
    if "main" not in skip:
        for dtype_name in args.dtypes.split(","):
            for K in (int(k) for k in args.ks.split(",")):
                peers = ["fairscale"] if peers_on and K == 2 and dtype_name == "fp32" else []
                run_config(T, D, F_, 16, K, "gelu", dtype_name, peers, reps, warmup)
            if peers_on:  # Mixtral is swiglu: compare it against a swiglu floor and layer
                run_config(T, D, F_, 16, 2, "swiglu", dtype_name, ["hf"], reps, warmup)
    if "fine" not in skip:  # fine-grained experts: Qwen3-30B-A3B's layer shape
        fine_T = 256 if q else (16384 if device().type == "cuda" else 512)
        fD, fF = (64, 32) if q else (2048, 768)
        for dtype_name in args.dtypes.split(","):
            run_config(fine_T, fD, fF, 64 if not q else 16, 8, "swiglu", dtype_name,
                       ["hf"] if peers_on else [], reps, warmup)
    if "sweep" not in skip:
        sweep_T = args.sweep_tokens or T
        run_sweep(sweep_T, D, F_, (4, 8, 16) if q else (8, 16, 32, 64, 128, 256), reps, warmup)


if __name__ == "__main__":
    main()
