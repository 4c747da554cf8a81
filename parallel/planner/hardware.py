"""The hardware a plan runs on: one GPU's memory, compute and links, and presets for the
GPUs people train MoE models on (`python -m parallel.planner --hw h100`).

Each preset is four data-sheet figures per GPU (dense bf16 tensor-core peak without
sparsity; HBM size; scale-up link bandwidth per direction; scale-out network bandwidth),
plus the host link:
  a100    A100 SXM4 80GB: 312 TFLOP/s, 80 GB HBM2e, NVLink 3 600 GB/s total (300 per
          direction), one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100), PCIe 4 x16
  h100    H100 SXM5: 989 TFLOP/s, 80 GB HBM3, NVLink 4 900 GB/s total (450 per direction),
          one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100), PCIe 5 x16
  h200    H200 SXM: 989 TFLOP/s, 141 GB HBM3e, NVLink 4 as H100, 400 Gb/s per GPU, PCIe 5
  h800    H800 SXM5 (the H100 with NVLink cut to 400 GB/s total, 200 per direction; DeepSeek-
          V3's cluster, which measured about 160 GB/s over it): 989 TFLOP/s, 80 GB HBM3, one
          400 Gb/s InfiniBand NIC per GPU, PCIe 5 x16
  b200    B200 (HGX B200): 2250 TFLOP/s, 180 GB HBM3e usable, NVLink 5 1.8 TB/s total (900
          per direction), 400 Gb/s per GPU (DGX B200), PCIe 5 x16
  mi300x  MI300X: 1307 TFLOP/s, 192 GB HBM3, Infinity Fabric 7 links of 64 GB/s per
          direction to the 7 peers (448), 400 Gb/s per GPU, PCIe 5 x16
(NVIDIA A100/H100/H200/B200 and AMD Instinct MI300X data sheets; HBM bandwidth 2.0, 3.35,
4.8, 8.0 and 5.3 TB/s.)

How the planner's numbers come from them -- one rule for every preset, nothing per model:
  achievable dense TFLOP/s = peak x GEMM_EFFICIENCY (0.70; bench/gemm_efficiency.py on an
                             H200, torch 2.11: bf16 8192^3 77.0% of 989, Mixtral's expert
                             matmuls 75.5% / 72.7%, a 16384 x 4096 x 12288 qkv 73.8%,
                             DeepSeek-V3's small expert matmul 56.3%; the step time divides
                             the model's FLOPs by it, so MFU can never exceed 0.70)
  GEMMs by shape           where the peak is known (presets, --peak-flops): the expert GEMMs
                             at their per-expert shape (m rows a local expert receives per
                             micro-batch, k, n) run at gemm_efficiency(m, k, n) of the peak
                             when that is below GEMM_EFFICIENCY (dense GEMMs, all inside the
                             measured range in the published layouts, stay at it); the rule
                             is stated at gemm_efficiency
  collective bandwidth     = link x the bus bandwidth NCCL reaches on it, as NVIDIA's NCCL
                             engineers state it for nccl-tests: inside a node (NVLink,
                             Infinity Fabric) SCALE_UP_EFFICIENCY = 370 / 450 (NVLink 4's
                             450 GB/s line rate gives about 370 GB/s after the protocol's
                             overhead, S. Jeaugey, NVIDIA/nccl-tests#212), between nodes
                             SCALE_OUT_EFFICIENCY = 47 / 50 (a 400 Gb/s NDR NIC should reach
                             46-48 GB/s, NVIDIA/nccl-tests#290; an all-to-all gets one NIC's
                             rate per GPU, NVIDIA/nccl-tests#267)
  collectives by size      every collective call pays a latency besides its bytes: NCCL's
                             own cost model (src/graph/tuning.cc, ncclTopoTuneModel, ring
                             algorithm, NCCL 2.2x): per protocol p in (LL, LL128, Simple)
                             t_p = base_p + s_intra hop_p(NVLink) + s_inter hop_p(network)
                                   + wire bytes of the call / (bandwidth x share_p),
                             the call's time the fastest protocol's (NCCL picks it), with
                             base (6.6, 14.0, 8.4) us, hop over NVLink (0.6, 1.9, 3.4) us,
                             over the network (2.7, 4.0, 14.0) us, share (1/4, 0.92, 1);
                             ring steps s: all-reduce 2(P-1) (2n of them between the n
                             nodes when n > 1), all-gather and reduce-scatter P-1 (n-1);
                             all-to-all and send/recv one step (every peer at once; a
                             network step where the group spans nodes). Small messages
                             thus run at a fraction of the bus bandwidth, as nccl-tests
                             curves show; at the tens of MB of the published runs' calls
                             the latency is a few percent
  FP8 GEMMs                precision=fp8: the blocks' GEMMs (not the head, not attention's
                             scores) at FP8_PEAKS x FP8_GEMM_EFFICIENCY (0.68: DeepGEMM's
                             1350 TFLOP/s of Hopper's 1979) instead of the bf16 rate, on a
                             preset whose compute capability runs both FP8 kernels (moe/fp8.py
                             fp8_kernels, the runtime's own predicate, with deep_gemm taken as
                             installed); the expert GEMMs' shape slowdown applies as in bf16;
                             the A100 (and a custom machine without --fp8-flops) runs them at
                             the bf16 rate. fp8_recipe=rowwise: per GEMM shape, bf16 where
                             the runtime keeps it bf16, else the rowwise kernel's measured
                             speed over bf16 (step_time.fp8_gemm_time)
  host copies              = PCIe x16 per direction x 0.80 (offload)
  MFU                      = model FLOPs per GPU per second / the *peak* (not achievable)
A custom machine: --flops (achievable), --peak-flops, --fp8-flops (achievable), --gpu-mem,
--intra-bw, --inter-bw.
"""
import math
from dataclasses import dataclass, replace

from moe.fp8 import fp8_kernels

GEMM_EFFICIENCY = 0.70
SCALE_UP_EFFICIENCY = 370.0 / 450.0     # NVLink 4: busbw / line rate (nccl-tests#212)
SCALE_OUT_EFFICIENCY = 47.0 / 50.0      # NDR 400 Gb/s: 46-48 GB/s per NIC (nccl-tests#290)
HOST_EFFICIENCY = 0.80                  # PCIe x16 copies (offload)
# The memory-bound work's bytes (traced_bytes.py: the eager ops' tensors, RMSNorm as its
# fused kernel) move at this share of the data-sheet HBM bandwidth. Measured with moekit's
# own training step on an H200 (torch 2.11, bench/gpu_step.py, docs/gpu-speed.md): the
# measured step less its GEMMs at GEMM_EFFICIENCY, over the traced bytes -- eager 0.426 for
# the Qwen3-30B-A3B-shaped MoE and 0.426 for its dense twin (small element-wise kernels, one
# launch each, far from the bandwidth a large copy reaches); compiled (parallel.compile=true,
# inductor fusing neighbours: fewer bytes, counted here as the eager bytes at a higher rate)
# 0.718 and 0.749. tests/unit/test_planner_membound.py re-derives them from the planner.
EAGER_HBM_EFFICIENCY = 0.43
COMPILED_HBM_EFFICIENCY = 0.73
# bf16 matmuls measured by bench/gemm_efficiency.py on an H200 (torch 2.11, cuBLAS):
# (m, k, n, share of the 989 TFLOP/s peak)
GEMM_MEASURED = ((8192, 8192, 8192, 0.770), (8192, 4096, 14336, 0.755),
                 (8192, 14336, 4096, 0.727), (4096, 7168, 2048, 0.563),
                 (16384, 4096, 12288, 0.738))


@dataclass(frozen=True)
class Hardware:
    gpu_mem_gb: float = 80.0        # memory per GPU (GB = 1e9 bytes)
    gpus_per_node: int = 8
    intra_bw_gbs: float = 150.0     # per-GPU collective bandwidth inside a node (GB/s)
    inter_bw_gbs: float = 25.0      # per-GPU collective bandwidth between nodes (GB/s)
    tflops: float = 150.0           # achievable dense TFLOP/s per GPU
    host_bw_gbs: float = 25.0       # host <-> device copy bandwidth per GPU (GB/s, PCIe 4 x16)
    peak_tflops: float = 0.0        # data-sheet dense bf16 peak (MFU's denominator); 0 = unknown
    hbm_tbs: float = 0.0            # HBM bandwidth (TB/s; the GEMM roofline); 0 = unknown
    fp8_tflops: float = 0.0         # achievable dense FP8 TFLOP/s per GPU; 0 = no FP8 rate known
    name: str = "custom"

    @property
    def gpu_mem_bytes(self) -> float:
        return self.gpu_mem_gb * 1e9


# name: (peak dense bf16 TFLOP/s, HBM GB, scale-up GB/s per direction, NIC Gb/s, PCIe GB/s
# per direction, HBM TB/s)
DATA_SHEETS = {
    "a100": (312.0, 80.0, 300.0, 200.0, 32.0, 2.039),
    "h100": (989.0, 80.0, 450.0, 400.0, 64.0, 3.35),
    "h200": (989.0, 141.0, 450.0, 400.0, 64.0, 4.8),
    "h800": (989.0, 80.0, 200.0, 400.0, 64.0, 3.35),
    "b200": (2250.0, 180.0, 900.0, 400.0, 64.0, 8.0),
    "mi300x": (1307.0, 192.0, 448.0, 400.0, 64.0, 5.3),
}


# dense FP8 (e4m3) tensor-core peaks without sparsity (TFLOP/s; data sheets: H100/H200/H800
# SXM 1979, B200 4500, MI300X 2615; the A100 has no FP8 tensor cores)
FP8_PEAKS = {"h100": 1979.0, "h200": 1979.0, "h800": 1979.0, "b200": 4500.0, "mi300x": 2615.0}
# the compute capability torch reports for each preset (ROCm reports the gfx arch: gfx942 = 9.4),
# which moe/fp8.py fp8_kernels turns into the FP8 kernels that run there
CAPABILITIES = {"a100": (8, 0), "h100": (9, 0), "h200": (9, 0), "h800": (9, 0), "b200": (10, 0),
                "mi300x": (9, 4)}
# FP8 GEMMs with fine-grained scaling reach 1350+ TFLOP/s on Hopper (DeepSeek's DeepGEMM at
# its release, H800 = H100's 1979 FP8 peak): 0.68 of the peak, the share every preset uses
FP8_GEMM_EFFICIENCY = 1350.0 / 1979.0


def membound_bandwidth(hw: "Hardware", compiled: bool) -> float:
    """Bytes per second the memory-bound work moves at (eager or compiled, see above)."""
    return hw.hbm_tbs * 1e12 * (COMPILED_HBM_EFFICIENCY if compiled else EAGER_HBM_EFFICIENCY)


def _log_flops(m, k, n) -> float:
    return math.log10(2.0 * m * k * n)


def gemm_efficiency(m: float, k: float, n: float, hw: "Hardware" = None) -> float:
    """Share of the peak a bf16 GEMM [m, k] x [k, n] reaches, by this rule between the
    GEMM_MEASURED points: piecewise linear in log10(FLOPs) between them (points of equal
    FLOPs averaged), the largest point's share above them, the smallest point's below them;
    and, where hw knows its peak and HBM bandwidth, never above the memory roofline: the
    FLOPs over the peak, divided by the longer of that time at the share and the time to
    move its operands and result (2 bytes each) through HBM."""
    pts = {}
    for pm, pk, pn, share in GEMM_MEASURED:
        pts.setdefault(pm * pk * pn, []).append(share)
    ys = [sum(pts[f]) / len(pts[f]) for f in sorted(pts)]
    xs = [_log_flops(f, 1, 1) for f in sorted(pts)]
    x = _log_flops(max(m, 1), max(k, 1), max(n, 1))
    if x <= xs[0]:
        share = ys[0]
    elif x >= xs[-1]:
        share = ys[-1]
    else:
        i = next(j for j in range(1, len(xs)) if x <= xs[j])
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        share = ys[i - 1] + t * (ys[i] - ys[i - 1])
    if hw is not None and hw.peak_tflops and hw.hbm_tbs:
        flops, nbytes = 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)
        at_peak = flops / (hw.peak_tflops * 1e12)
        share = at_peak / max(at_peak / share, nbytes / (hw.hbm_tbs * 1e12))
    return share


# NCCL's ring cost model (see "collectives by size" above): per protocol (LL, LL128, Simple)
NCCL_BASE_US = (6.6, 14.0, 8.4)
NCCL_HOP_US = {"intra": (0.6, 1.9, 3.4), "inter": (2.7, 4.0, 14.0)}
NCCL_BW_SHARE = (0.25, 0.92, 1.0)


def ring_steps(collective: str, ranks: int, nodes: int) -> tuple:
    """(ring steps, of them between nodes) of one call on a group of `ranks` over `nodes`."""
    if collective == "reduce":
        return 2 * (ranks - 1), (2 * nodes if nodes > 1 else 0)
    if collective in ("gather", "scatter", "reduce_scatter_pair"):
        return ranks - 1, nodes - 1
    return 1, int(nodes > 1)


def call_seconds(collective: str, ranks: int, nodes: int, wire_bytes: float,
                 bandwidth: float) -> float:
    """Seconds of one collective call putting wire_bytes on links of `bandwidth` bytes/s:
    the fastest protocol of NCCL's ring cost model (module docstring)."""
    steps, inter = ring_steps(collective, ranks, nodes)
    best = float("inf")
    for p, share in enumerate(NCCL_BW_SHARE):
        latency = NCCL_BASE_US[p] + (steps - inter) * NCCL_HOP_US["intra"][p] + \
            inter * NCCL_HOP_US["inter"][p]
        best = min(best, latency * 1e-6 + wire_bytes / (bandwidth * share))
    return best


def preset(name: str, gpus_per_node: int = 8) -> Hardware:
    """The Hardware of a data-sheet GPU (see the module docstring for the derivation)."""
    if name not in DATA_SHEETS:
        raise ValueError(f"--hw {name!r} is not a preset; use one of {', '.join(DATA_SHEETS)} "
                         f"(or give --flops/--gpu-mem/--intra-bw/--inter-bw)")
    peak, mem, link, nic_gbit, pcie, hbm = DATA_SHEETS[name]
    # the FP8 rate is DeepGEMM's, so a preset is priced as a machine with deep_gemm installed
    # (on the MI300X an assumption: DeepGEMM builds for CUDA only, so the runtime emulates there)
    kernels = fp8_kernels(CAPABILITIES[name], deep_gemm=True)
    fp8_peak = FP8_PEAKS.get(name, 0.0) if kernels.matmul and kernels.grouped else 0.0
    return Hardware(gpu_mem_gb=mem, gpus_per_node=gpus_per_node,
                    intra_bw_gbs=link * SCALE_UP_EFFICIENCY,
                    inter_bw_gbs=nic_gbit / 8 * SCALE_OUT_EFFICIENCY,
                    tflops=peak * GEMM_EFFICIENCY, host_bw_gbs=pcie * HOST_EFFICIENCY,
                    peak_tflops=peak, hbm_tbs=hbm,
                    fp8_tflops=fp8_peak * FP8_GEMM_EFFICIENCY, name=name)


def with_overrides(hw: Hardware, **given) -> Hardware:
    """hw with the fields the user gave explicitly (None = keep)."""
    return replace(hw, **{k: v for k, v in given.items() if v is not None})
