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
  b200    B200 (HGX B200): 2250 TFLOP/s, 180 GB HBM3e usable, NVLink 5 1.8 TB/s total (900
          per direction), 400 Gb/s per GPU (DGX B200), PCIe 5 x16
  mi300x  MI300X: 1307 TFLOP/s, 192 GB HBM3, Infinity Fabric 7 links of 64 GB/s per
          direction to the 7 peers (448), 400 Gb/s per GPU, PCIe 5 x16
(NVIDIA A100/H100/H200/B200 and AMD Instinct MI300X data sheets.)

How the planner's numbers come from them -- one rule for every preset, nothing per model:
  achievable dense TFLOP/s = peak x GEMM_EFFICIENCY (0.70; bench/gemm_efficiency.py on an
                             H200, torch 2.11: bf16 8192^3 77.0% of 989, Mixtral's expert
                             matmuls 75.5% / 72.7%, a 16384 x 4096 x 12288 qkv 73.8%,
                             DeepSeek-V3's small expert matmul 56.3%; the step time divides
                             the model's FLOPs by it, so MFU can never exceed 0.70)
  collective bandwidth     = link x BUS_EFFICIENCY (0.80: ring/pairwise collectives reach
                             about 80% of the per-direction link rate as bus bandwidth),
                             NVLink/Infinity Fabric inside a node, the NIC between nodes
  host copies              = PCIe x16 per direction x 0.80 (offload)
  MFU                      = model FLOPs per GPU per second / the *peak* (not achievable)
A custom machine: --flops (achievable), --peak-flops, --gpu-mem, --intra-bw, --inter-bw.
"""
from dataclasses import dataclass, replace

GEMM_EFFICIENCY = 0.70
BUS_EFFICIENCY = 0.80


@dataclass(frozen=True)
class Hardware:
    gpu_mem_gb: float = 80.0        # memory per GPU (GB = 1e9 bytes)
    gpus_per_node: int = 8
    intra_bw_gbs: float = 150.0     # per-GPU collective bandwidth inside a node (GB/s)
    inter_bw_gbs: float = 25.0      # per-GPU collective bandwidth between nodes (GB/s)
    tflops: float = 150.0           # achievable dense TFLOP/s per GPU
    host_bw_gbs: float = 25.0       # host <-> device copy bandwidth per GPU (GB/s, PCIe 4 x16)
    peak_tflops: float = 0.0        # data-sheet dense bf16 peak (MFU's denominator); 0 = unknown
    name: str = "custom"

    @property
    def gpu_mem_bytes(self) -> float:
        return self.gpu_mem_gb * 1e9


# name: (peak dense bf16 TFLOP/s, HBM GB, scale-up GB/s per direction, NIC Gb/s, PCIe GB/s per direction)
DATA_SHEETS = {
    "a100": (312.0, 80.0, 300.0, 200.0, 32.0),
    "h100": (989.0, 80.0, 450.0, 400.0, 64.0),
    "h200": (989.0, 141.0, 450.0, 400.0, 64.0),
    "b200": (2250.0, 180.0, 900.0, 400.0, 64.0),
    "mi300x": (1307.0, 192.0, 448.0, 400.0, 64.0),
}


def preset(name: str, gpus_per_node: int = 8) -> Hardware:
    """The Hardware of a data-sheet GPU (see the module docstring for the derivation)."""
    if name not in DATA_SHEETS:
        raise ValueError(f"--hw {name!r} is not a preset; use one of {', '.join(DATA_SHEETS)} "
                         f"(or give --flops/--gpu-mem/--intra-bw/--inter-bw)")
    peak, mem, link, nic_gbit, pcie = DATA_SHEETS[name]
    return Hardware(gpu_mem_gb=mem, gpus_per_node=gpus_per_node,
                    intra_bw_gbs=link * BUS_EFFICIENCY, inter_bw_gbs=nic_gbit / 8 * BUS_EFFICIENCY,
                    tflops=peak * GEMM_EFFICIENCY, host_bw_gbs=pcie * BUS_EFFICIENCY,
                    peak_tflops=peak, name=name)


def with_overrides(hw: Hardware, **given) -> Hardware:
    """hw with the fields the user gave explicitly (None = keep)."""
    return replace(hw, **{k: v for k, v in given.items() if v is not None})
