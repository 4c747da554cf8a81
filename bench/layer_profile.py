"""Profile one forward+backward of the MoE layer on a GPU: kernel launches, host syncs, and the
top kernels by GPU time (torch.profiler), beside the op census of the same step.

Run (CUDA): python bench/layer_profile.py [--tokens 16384 --d-model 2048 --d-ff 1024
            --experts 16 --top-k 2 --activation gelu]
Shapes: T tokens, D model dim, F expert ffn dim, E experts, K top-k.
"""
import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe import MoELayer  # noqa: E402
from moe.profiling.census import OpCensus  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--activation", default="gelu")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_profile: no CUDA device; nothing to profile")
        return 0
    layer = MoELayer(a.d_model, a.d_ff, a.experts, a.top_k, None, a.activation).to(
        device="cuda", dtype=torch.bfloat16)
    x = torch.randn(a.tokens, a.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)
    for _ in range(3):
        layer(x).backward(gy)
    torch.cuda.synchronize()
    with OpCensus() as census:
        layer(x).backward(gy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        layer(x).backward(gy)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                    "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    syncs = collections.Counter(e.name for e in events if e.name in SYNC_CALLS)
    d2h = sum(1 for e in events if e.name == "cudaMemcpyAsync" and "DtoH" in str(getattr(e, "name", "")))
    gpu_us = collections.Counter()
    for e in kernels:
        gpu_us[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    s = census.summary(x.numel() * x.element_size())
    print(f"shape T={a.tokens} D={a.d_model} F={a.d_ff} E={a.experts} k={a.top_k} {a.activation} bf16")
    print(f"kernels {len(kernels)}  launches {launches}  syncs {dict(syncs) or 0}  (the last "
          f"synchronize is the profiler's own)  DtoH copies {d2h}")
    print(f"GPU time {sum(gpu_us.values()) / 1e3:.2f} ms over {len(kernels)} kernels")
    print(f"census: {s['ops']} ops, {s['syncs']} host syncs {s['sync_ops']}, {s['bytes_x']}x input bytes")
    print("top 10 kernels by GPU time:")
    for name, us in gpu_us.most_common(10):
        print(f"  {us / 1e3:8.3f} ms  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
