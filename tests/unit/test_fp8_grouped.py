"""The banks' grouped FP8 GEMM path (moe/fp8.py grouped_fp8_ffn, taken on CUDA SM90+ where
torchao's DeepGEMM backend is installed) checked on this CPU through a stand-in for the
kernel: it asserts what torchao's `_to_fp8_blockwise_then_scaled_grouped_mm` asserts (A 2-D
row-major bf16/fp32, B_t [E, K, N] column-major per expert, int32 end offsets matching A's
rows, K and N multiples of 128, bf16 out) and computes each group as the kernel does with its
tiles, written by hand (tests/unit/fp8_reference.py: scales and e4m3 rounding per tile,
float64 GEMM, DeepSeek-V3's FP8 backward) -- not with moe/fp8.py's emulation.
Both the bank through the stand-in and the bank's emulation path (fp8_matmul per expert) must
equal an independent per-expert reference: a loop over the experts with rows, each GEMM the
hand FP8 GEMM of its expert's rows and weights, biases and the activation in bf16 between
them, gradients by autograd through it. So the offsets, the weight layout, biases per row,
the activation, moe_act recomputation and the gradients to the fp32 masters are checked, and
so is the emulation itself: a wrong emulation no longer agrees with a stand-in made of it.
Bound: 2^-7 of each tensor's largest value, two bf16 ulps: the reference accumulates in
float64 and the emulation in fp32, so a bf16 rounding between the GEMMs may land on the other
neighbour, and the activation's bf16 kernels round their own way (measured: the stand-in
path bit-equal to the reference, the emulation 2.1e-4 at most, on w2's gradient); a wrong
offset, layout or FP8 rounding (a bf16 backward, a wrong scale) is 2^-4 of a term or O(1)
off (measured 6e-2 for a bf16 backward, 1.4 for biases on the wrong rows). The kernel
itself against the emulation is tests/gpu/test_fp8_cuda.py's (GPU tier).
"""
import pytest
import torch
import torch.nn.functional as F

import moe.experts as experts
from moe.experts import ExpertBank
from moe.fp8 import grouped_fp8_kernel
from tests.tolerance import max_rel_err
from tests.unit.fp8_reference import hand_fp8_matmul

D, F_ = 128, 256
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
        outs = [hand_fp8_matmul(A[s:e], B_t[g], out_dtype) if e > s
                else A.new_zeros(0, N, dtype=out_dtype)   # empty group: no rows
                for g, (s, e) in enumerate(zip(starts, offs.tolist()))]
        return torch.cat(outs)
    return kernel


def _run(bank, x, counts, gy):
    for p in bank.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = bank(x, counts)
    (y.float() * gy).sum().backward()
    return [y.detach().float(), x.grad] + [p.grad.clone() for p in bank.parameters()]


def _reference(bank, x, counts, gy):
    """Expert by expert, by hand: h1 = fp8(x_e, w1[e]) + b1[e] (and h3 with w3, b3), a =
    silu(h1) h3 or gelu(h1), y_e = fp8(a, w2[e]) + b2[e], in bf16 between the GEMMs (the
    compute dtype under autocast); an expert with no rows is skipped (zero gradients)."""
    P = {n: p.detach().clone().requires_grad_() for n, p in bank.named_parameters()}
    x = x.clone().requires_grad_()
    xb, outs, lo = x.bfloat16(), [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe, lo = xb[lo:lo + n], lo + n

        def proj(a, w, b):
            h = hand_fp8_matmul(a, P[w][e], torch.bfloat16)
            return h if b not in P else h + P[b][e].bfloat16()
        h1 = proj(xe, "w1", "b1")
        a = F.silu(h1) * proj(xe, "w3", "b3") if bank.gated else F.gelu(h1)
        outs.append(proj(a, "w2", "b2"))
    y = torch.cat(outs)
    (y.float() * gy).sum().backward()
    return [y.detach().float(), x.grad] + [P[n].grad for n, _ in bank.named_parameters()]


@pytest.mark.parametrize("activation, bias, recompute", [("swiglu", True, False), ("gelu", False, True)])
def test_grouped_fp8_path_and_the_emulation_equal_a_per_expert_reference(monkeypatch, activation, bias, recompute):
    torch.manual_seed(0)
    bank = ExpertBank(3, D, F_, activation, bias)
    with torch.no_grad():
        for p in (bank.b1, bank.b2, bank.b3):
            if p is not None:
                p.normal_()
    bank.set_fp8(True)
    bank.set_recompute_act(recompute)
    counts = [5, 0, 9]   # an expert with no rows
    x, gy = torch.randn(14, D), torch.randn(14, D)
    want = _reference(bank, x, counts, gy)
    emulated = _run(bank, x, counts, gy)
    calls = []
    monkeypatch.setattr(experts, "grouped_fp8_kernel", lambda device: _stand_in(calls))
    grouped = _run(bank, x, counts, gy)
    gemms = 3 if activation == "swiglu" else 2
    # one call per projection; moe_act runs w2's again in backward
    assert len(calls) == gemms + recompute and calls[0] == ((14, D), (3, D, F_)), calls
    assert len(want) == len(grouped) == len(emulated)
    for path, got in (("grouped", grouped), ("emulation", emulated)):
        for name, g, w in zip(NAMES, got, want):
            diff = max_rel_err(g, w)
            assert diff <= BOUND, (path, name, diff)
    assert grouped[2][1].abs().sum() == 0 and grouped[2][0].abs().sum() > 0   # idle expert 1


def test_no_kernel_off_cuda():
    assert grouped_fp8_kernel(torch.device("cpu")) is None
