"""The banks' grouped FP8 GEMM path (moe/fp8.py grouped_fp8_ffn, taken on CUDA SM90+ where
torchao's DeepGEMM backend is installed) checked on this CPU through a stand-in for the
kernel: it asserts what torchao's `_to_fp8_blockwise_then_scaled_grouped_mm` asserts (A 2-D
row-major bf16/fp32, B_t [E, K, N] column-major per expert, int32 end offsets matching A's
rows, K and N multiples of 128, bf16 out) and computes each expert's group with the emulation
(fp8_matmul), as the kernel computes it with its tiles. The bank through the stand-in must
then equal the bank's emulation path (the same operations on the same values): the offsets,
the weight layout, biases per row, the activation, moe_act recomputation and the gradients to
the fp32 masters are wired right. Bound: 2^-7 of each tensor's largest value, two bf16 ulps
(measured: everything bit-equal but one element of dx, 5e-4 apart: the activation runs over
all rows at once here and per expert there, and its vectorised kernel's tail rounds
differently); a wrong offset or layout is O(1) off. The kernel itself against the emulation is
tests/gpu/test_fp8_cuda.py's (GPU tier).
"""
import pytest
import torch

import moe.experts as experts
from moe.experts import ExpertBank
from moe.fp8 import fp8_matmul, grouped_fp8_kernel
from tests.tolerance import max_rel_err

D, F = 128, 256
BOUND = 2 ** -7
NAMES = ["y", "dx", "w1", "w2", "w3", "b1", "b2", "b3"]


def _stand_in(calls):
    def kernel(A, B_t, offs, out_dtype=torch.bfloat16):
        assert A.ndim == 2 and A.stride(-1) == 1 and A.dtype in (torch.bfloat16, torch.float32)
        E, K, N = B_t.shape
        assert B_t.stride(-2) == 1 and B_t.stride(-1) == K, "B_t not column-major per expert"
        assert B_t.dtype in (torch.bfloat16, torch.float32) and K % 128 == 0 and N % 128 == 0
        assert offs.dtype == torch.int32 and offs.shape == (E,) and int(offs[-1]) == A.shape[0]
        assert out_dtype == torch.bfloat16 and A.shape[1] == K
        calls.append((tuple(A.shape), (E, K, N)))
        starts = [0] + offs[:-1].tolist()
        outs = [fp8_matmul(A[s:e], B_t[g]) if e > s else A.new_zeros(0, N)   # empty group: no rows
                for g, (s, e) in enumerate(zip(starts, offs.tolist()))]
        return torch.cat(outs).to(out_dtype)
    return kernel


def _run(bank, x, counts, gy):
    for p in bank.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = bank(x, counts)
    (y.float() * gy).sum().backward()
    return [y.detach().float(), x.grad] + [p.grad.clone() for p in bank.parameters()]


@pytest.mark.parametrize("activation, bias, recompute", [("swiglu", True, False), ("gelu", False, True)])
def test_grouped_fp8_path_equals_the_emulation(monkeypatch, activation, bias, recompute):
    torch.manual_seed(0)
    bank = ExpertBank(3, D, F, activation, bias)
    with torch.no_grad():
        for p in (bank.b1, bank.b2, bank.b3):
            if p is not None:
                p.normal_()
    bank.set_fp8(True)
    bank.set_recompute_act(recompute)
    counts = [5, 0, 9]   # an expert with no rows
    x, gy = torch.randn(14, D), torch.randn(14, D)
    want = _run(bank, x, counts, gy)
    calls = []
    monkeypatch.setattr(experts, "grouped_fp8_kernel", lambda device: _stand_in(calls))
    got = _run(bank, x, counts, gy)
    gemms = 3 if activation == "swiglu" else 2
    # one call per projection; moe_act runs w2's again in backward
    assert len(calls) == gemms + recompute and calls[0] == ((14, D), (3, D, F)), calls
    for name, g, w in zip(NAMES, got, want):
        diff = max_rel_err(g, w)
        assert diff <= BOUND, (name, diff)


def test_no_kernel_off_cuda():
    assert grouped_fp8_kernel(torch.device("cpu")) is None
