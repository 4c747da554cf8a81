"""parallel.precision=fp8 on CUDA (issue 47's GPU proof): the CPU emulation against what the
GPU runs.

1. An FP8 expert bank's emulation (moe/fp8.py) on CUDA equals the same bank on CPU: the same
   quantization of the same bf16 inputs, GEMMs accumulated in fp32 in another order.
2. torchao's Float8Linear with its FP8 tensor-core matmul (torch._scaled_mm, compute
   capability >= 8.9) equals its emulation (emulate=True) on the same GPU, both recipes.
3. The banks' grouped FP8 kernel (torchao's blockwise grouped GEMM on DeepGEMM,
   moe/fp8.py grouped_fp8_kernel: SM90+ with `deep_gemm` installed) equals the emulation,
   output and every gradient.
Bound: 2^-4 of each tensor's largest value, from the formats: an fp32 summation-order
difference can move a value across an e4m3 rounding midpoint, and the flipped value moves by
up to 2^-4 of itself; FP8 matmul kernels may accumulate with less than fp32 precision between
promotions (Hopper's fast accumulation). A wrong scale, a wrong tile or a transposed operand
is O(1) off. Measured on one H200 (torch 2.11, 2026-11-28): the bank's emulation on CUDA
against the CPU, y 0.032 (over the 3e-2 first guessed, a flip after the activation's
re-quantization); torchao's Float8Linear against its emulation within 3e-2, both recipes;
the rowwise kernel against its emulation y 0.018, dx 0.021, weight gradients 0.0028-0.0035.
Run: python -m pytest tests/gpu/test_fp8_cuda.py -q -rs
"""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import moe.experts as experts
from moe.experts import ExpertBank
from moe.fp8 import grouped_fp8_kernel
from tests.tolerance import max_rel_err

D, F, E = 256, 512, 4
BOUND = 2 ** -4
pytestmark = pytest.mark.usefixtures("no_tf32")


def _bank_run(bank, x, counts, gy, dev):
    bank = bank.to(dev)
    x = x.detach().to(dev).requires_grad_()  # a leaf on every device (x.to(cuda) of a leaf is not)
    with torch.autocast(dev.type, torch.bfloat16):
        y = bank(x, counts)
    (y.float() * gy.to(dev)).sum().backward()
    return [y, x.grad] + [p.grad for p in bank.parameters()]


def _bank():
    torch.manual_seed(0)
    bank = ExpertBank(E, D, F, "swiglu")
    bank.set_fp8(True)
    counts = [70, 0, 300, 142]   # groups not multiples of 128, one empty
    T = sum(counts)
    return bank, counts, torch.randn(T, D), torch.randn(T, D)


def test_bank_emulation_on_cuda_equals_cpu(monkeypatch):
    monkeypatch.setattr(experts, "grouped_fp8_kernel", lambda device: None)
    bank, counts, x, gy = _bank()
    cpu = _bank_run(copy.deepcopy(bank), x, counts, gy, torch.device("cpu"))
    gpu = _bank_run(copy.deepcopy(bank), x, counts, gy, torch.device("cuda"))
    for name, g, c in zip(["y", "dx", "w1", "w2", "w3"], gpu, cpu):
        assert max_rel_err(g, c) <= BOUND, (name, max_rel_err(g, c))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_kernel_equals_its_emulation(recipe):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor-core matmuls need compute capability >= 8.9")
    from parallel.fp8 import _torchao_float8
    Float8Linear, Config, _ = _torchao_float8(torch.device("cuda"))
    torch.manual_seed(0)
    base = nn.Linear(D, F, bias=False).cuda()
    x, gy = torch.randn(64, D, device="cuda"), torch.randn(64, F, device="cuda")
    out = []
    for emulate in (False, True):
        config = dataclasses.replace(Config.from_recipe_name(recipe), emulate=emulate)
        m = Float8Linear.from_float(copy.deepcopy(base), config=config)
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y = m(xi)
        (y.float() * gy).sum().backward()
        out.append((y, xi.grad, m.weight.grad))
    for name, k, e in zip(["y", "dx", "dw"], *out):
        assert max_rel_err(k, e) <= BOUND, (recipe, name, max_rel_err(k, e))


def test_grouped_fp8_kernel_equals_the_emulation(monkeypatch):
    dev = torch.device("cuda")
    if grouped_fp8_kernel(dev) is None:
        pytest.skip("torchao's grouped blockwise FP8 kernel needs SM90+ and deep_gemm installed "
                    "(without it torchao only emulates, as moekit does)")
    bank, counts, x, gy = _bank()
    real, calls = grouped_fp8_kernel(dev), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(experts, "grouped_fp8_kernel", lambda device: counted)
    kernel = _bank_run(copy.deepcopy(bank), x, counts, gy, dev)
    assert len(calls) == 3, calls   # w1, w3, w2: the bank ran on the kernel
    monkeypatch.setattr(experts, "grouped_fp8_kernel", lambda device: None)
    emulated = _bank_run(copy.deepcopy(bank), x, counts, gy, dev)
    for name, k, e in zip(["y", "dx", "w1", "w2", "w3"], kernel, emulated):
        assert max_rel_err(k, e) <= BOUND, (name, max_rel_err(k, e))


def test_rowwise_bank_kernel_equals_its_emulation(monkeypatch):
    """parallel.fp8_recipe=rowwise (moe/fp8_rowwise.py): the bank on torch._scaled_grouped_mm
    against the same bank with the kernel's emulation, on the same GPU: both quantize with
    the same code, so they differ by the kernel's accumulation order and bf16 output rounding,
    which re-quantizing the activation (and dy) can turn into an e4m3 flip: BOUND, as above
    (measured on an H200: y 0.018, dx 0.021, weight gradients 0.0028-0.0035; the CPU contract
    test holds 2^-7 against an independent emulation of identical fp32 arithmetic). The
    measured values are printed (-rA shows them)."""
    import moe.fp8_rowwise as rw
    from moe.fp8 import device_fp8_kernels
    dev = torch.device("cuda")
    if not device_fp8_kernels(dev).rowwise:
        pytest.skip("torch._scaled_grouped_mm needs compute capability 9.0+")
    bank, counts, x, gy = _bank()
    bank.set_fp8(True, "rowwise", where_it_pays=False)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return torch._scaled_grouped_mm(*args, **kwargs)
    monkeypatch.setattr(experts, "scaled_grouped_kernel", lambda device, kernels: counted)
    real = _bank_run(copy.deepcopy(bank), x, torch.tensor(counts, device=dev), gy, dev)
    assert len(calls) == 6, calls    # w1, w3, w2 forward; their dgrads
    monkeypatch.setattr(experts, "scaled_grouped_kernel",
                        lambda device, kernels: rw.emulated_scaled_grouped_mm)
    emulated = _bank_run(copy.deepcopy(bank), x, counts, gy, dev)
    errs = {n: max_rel_err(k, e) for n, k, e in zip(["y", "dx", "w1", "w2", "w3"], real, emulated)}
    print("rowwise kernel vs emulation, max rel err:", errs)
    assert all(v <= BOUND for v in errs.values()), errs
