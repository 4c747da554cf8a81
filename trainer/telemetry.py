"""Per-step model FLOPs, TFLOP/s and MFU: the planner's FLOPs function, so train.py and the
planner can never disagree.

step_flops(cfg, model)  model FLOPs of one optimizer step: parallel/planner/flops.model_flops
                  on the whole single-device model (train.py's, before parallelize; 3 x forward -- forward + backward,
                  no recomputation, no routing imbalance -- the whole model on the global
                  batch, attention's QK^T and AV included), as published runs count them.
tflops            step_flops / ranks / measured step time / 1e12: model TFLOP/s per rank.
mfu               tflops / the device's peak: log.peak_tflops when set, else the data-sheet
                  dense bf16 peak of a known GPU (parallel/planner/hardware.py: A100, H100,
                  H200, B200, MI300X, matched in torch's device name); absent where no peak
                  is known (a CPU without log.peak_tflops), never invented.
"""
import torch


def step_flops(cfg, model) -> float:
    """Model FLOPs of one optimizer step of `model` (the whole model, any device, meta too)."""
    from parallel.planner.flops import model_costs, model_flops
    from parallel.planner.workload import Workload

    from .planning import stream_tokens
    w = Workload(lambda: model, cfg.model, cfg.moe, cfg.train.batch_size, stream_tokens(cfg))
    return model_flops(model_costs(model, w), w)


# torch.cuda.get_device_name substrings -> hardware.py presets (the longer names first)
_GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("B200", "b200"),
              ("MI300X", "mi300x"))


def preset_for_name(device_name: str):
    """The hardware.py preset of a GPU named `device_name` (h100, ...), or None."""
    return next((preset for key, preset in _GPU_NAMES if key in device_name.upper()), None)


def preset_for_device(device: torch.device):
    """The preset of this run's device: a known GPU's, else None (a CPU, another GPU)."""
    if device.type != "cuda":
        return None
    return preset_for_name(torch.cuda.get_device_name(device))


def _peak_of(preset):
    """The data-sheet dense bf16 peak TFLOP/s of a hardware.py preset, or None (no preset)."""
    from parallel.planner.hardware import DATA_SHEETS
    return DATA_SHEETS[preset][0] if preset else None


def peak_for_name(device_name: str):
    """The data-sheet dense bf16 peak TFLOP/s of a GPU named `device_name`, or None."""
    return _peak_of(preset_for_name(device_name))


def device_peak_tflops(configured: float, device: torch.device):
    """log.peak_tflops if set (> 0), else a known GPU's peak, else None (no mfu)."""
    if configured > 0:
        return float(configured)
    return _peak_of(preset_for_device(device))
