"""parallel.precision=fp8 is never silently slower (issue 60, item 2): on a GPU whose FP8
GEMMs would run the emulation, train.py's validation refuses the run in one line naming the
GEMMs and the fix; with the kernels present, and on a CPU (the emulation is the tests'
reference), it runs. The kernels are the one predicate moe/fp8.py fp8_kernels decides, which
the runtime and the planner also ask; a GPU is stood in for by patching the device type and
its capability."""
import pytest
import torch

import moe.fp8 as fp8
import trainer.config as config
from trainer.config import ConfigError, load_config, validate

FP8 = ["parallel.precision=fp8"]


def _on_gpu(monkeypatch, capability, deep_gemm):
    monkeypatch.setattr(config, "run_device_type", lambda cfg: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fp8, "device_fp8_kernels",
                        lambda device: fp8.fp8_kernels(capability, deep_gemm))


@pytest.mark.parametrize("capability, deep_gemm, words", [
    ((9, 0), False, ["expert banks' and FFNs' 128x128-block GEMMs"]),
    ((8, 9), False, ["expert banks'"]),
    ((8, 0), True, ["expert banks'", "attention Linears' GEMMs (FP8 matmuls need compute capability 8.9+)"]),
])
def test_emulated_fp8_on_a_gpu_is_refused_in_one_line(monkeypatch, capability, deep_gemm, words):
    _on_gpu(monkeypatch, capability, deep_gemm)
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, FP8), 1)
    line = str(e.value)
    assert "\n" not in line and line.startswith("parallel.precision=fp8 on this GPU would run ")
    assert all(w in line for w in words), line
    assert line.endswith("set parallel.fp8_recipe=rowwise (SM90+), install deep_gemm (SM90+) "
                         "for the blockwise banks, or set parallel.precision=bf16"), line


def test_rowwise_runs_on_sm90_without_deep_gemm_and_is_refused_before_it(monkeypatch):
    rowwise = FP8 + ["parallel.fp8_recipe=rowwise"]
    _on_gpu(monkeypatch, (9, 0), False)
    assert validate(load_config(None, rowwise), 1).fp8_recipe == "rowwise"
    _on_gpu(monkeypatch, (8, 9), True)
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, rowwise), 1)
    line = str(e.value)
    assert "\n" not in line and "rowwise GEMMs (torch._scaled_grouped_mm needs compute capability 9.0+)" in line
    assert line.endswith("as an emulation, slower than bf16; set parallel.precision=bf16"), line


def test_fp8_runs_where_its_kernels_do_and_on_a_cpu(monkeypatch):
    assert validate(load_config(None, FP8 + ["run.device=cpu"]), 1).precision == "fp8"
    _on_gpu(monkeypatch, (9, 0), True)
    assert validate(load_config(None, FP8), 1).precision == "fp8"
    assert validate(load_config(None, ["parallel.precision=bf16"]), 1).precision == "bf16"
