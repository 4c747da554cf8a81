"""Rowwise FP8 expert banks (issue 60, item 1; moe/fp8_rowwise.py), on this CPU.

1. The call matches torch._scaled_grouped_mm's contract: every call the bank makes is replayed
   on meta tensors of the same shapes, strides and dtypes through torch's own registration of
   the op (its meta kernel holds the CUDA kernel's checks: e4m3 operands, mat_a row-major,
   mat_b column-major, fp32 scales [T] and [E, N], int32 offsets [E]); a call it rejects fails
   the test. Forward, dgrad: 3 + 3 calls for a gated bank.
2. The bank's output and gradients equal an independent emulation written here as plain
   per-expert loops (its own quantization: amax / 448 scales, e4m3 rounding by .to(); its own
   SwiGLU), never the code under test. Both round the same inputs to the same e4m3 values, so
   they differ by fp32 summation order and bf16 output rounding only: bound 2^-7 of each
   tensor's largest value (bf16's unit roundoff is 2^-8; a value within one bf16 ulp of a
   rounding midpoint, in a tensor fed back into the next quantization, can move an e4m3 value
   by up to 2^-4 of itself, rare at these sizes). Against unquantized fp32 GEMMs the bank is
   within 2^-3 (e4m3's unit roundoff 2^-4 on each operand, measured 0.037 on an H200 for
   unit-normal data), and a wrong scale layout (scales swapped between the two operands'
   dims) is O(1) off: the negative control.
3. Where the kernel runs for real, a projection whose shape cannot gain stays bf16, by the
   stated cost model (rowwise_pays); the CPU emulation runs every projection in FP8.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import moe.experts as experts
import moe.fp8_rowwise as rw
from moe.experts import ExpertBank
from moe.fp8 import FP8Kernels
from tests.tolerance import max_rel_err

D, FF, E = 64, 96, 4
pytestmark = pytest.mark.lowp
COUNTS = [30, 0, 41, 57]   # one empty expert, groups of no particular multiple
E4M3 = torch.float8_e4m3fn


def _meta_like(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _checked_kernel(calls, emulate=rw.emulated_scaled_grouped_mm):
    def kernel(a, b, scale_a, scale_b, offs=None, out_dtype=None):
        out = torch._scaled_grouped_mm(*map(_meta_like, (a, b, scale_a, scale_b)),
                                       offs=_meta_like(offs), out_dtype=out_dtype)
        calls.append((tuple(a.shape), tuple(b.shape), b.stride(), tuple(scale_a.shape),
                      tuple(scale_b.shape), offs.dtype))
        assert out.shape == (a.shape[0], b.shape[-1])
        return emulate(a, b, scale_a, scale_b, offs, out_dtype)
    return kernel


def _bank_and_data():
    torch.manual_seed(0)
    bank = ExpertBank(E, D, FF, "swiglu")
    bank.set_fp8(True, "rowwise", where_it_pays=False)
    T = sum(COUNTS)
    return bank, torch.randn(T, D), torch.randn(T, D)


def _run(bank, x, gy, counts):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        y = bank(x, counts)
    (y.float() * gy).sum().backward()
    return [y, x.grad, bank.w1.grad, bank.w2.grad, bank.w3.grad]


def _use_kernel(monkeypatch, kernel):
    monkeypatch.setattr(experts, "device_fp8_kernels", lambda device: FP8Kernels(True, False, True))
    monkeypatch.setattr(experts, "scaled_grouped_kernel", lambda device, kernels: kernel)


# the independent emulation: per expert, plain ops ------------------------------------------
def _q(x, dim):
    amax = x.abs().amax(dim, keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / s).clamp(-448, 448).to(E4M3).float() * s


def _reference(bank, x, gy):
    """(y, dx, dw1, dw2, dw3) with forward and dgrad on rowwise-rounded operands in fp32, bf16
    outputs, bf16 weight gradients, SwiGLU by autograd in bf16."""
    w1, w2, w3 = (w.detach().float() for w in (bank.w1, bank.w2, bank.w3))
    xb, outs = x.bfloat16(), {k: [] for k in ("y", "dx", "dw1", "dw2", "dw3")}
    start = 0
    for e, n in enumerate(COUNTS):
        xe, ge = xb[start:start + n], gy[start:start + n].bfloat16()
        start += n
        h1 = (_q(xe.float(), 1) @ _q(w1[e], 0)).bfloat16().requires_grad_()
        h3 = (_q(xe.float(), 1) @ _q(w3[e], 0)).bfloat16().requires_grad_()
        a = F.silu(h1) * h3
        y = (_q(a.detach().float(), 1) @ _q(w2[e], 0)).bfloat16()
        da = (_q(ge.float(), 1) @ _q(w2[e], 1).T).bfloat16()
        dh1, dh3 = torch.autograd.grad(a, (h1, h3), da)
        dx = (_q(dh1.float(), 1) @ _q(w1[e], 1).T).bfloat16().float() + \
            (_q(dh3.float(), 1) @ _q(w3[e], 1).T).bfloat16().float()
        outs["y"].append(y.float())
        outs["dx"].append(dx)
        outs["dw1"].append((xe.float().T @ dh1.float()).bfloat16().float())
        outs["dw2"].append((a.detach().float().T @ ge.float()).bfloat16().float())
        outs["dw3"].append((xe.float().T @ dh3.float()).bfloat16().float())
    return [torch.cat(outs["y"]), torch.cat(outs["dx"])] + [torch.stack(outs[k]) for k in ("dw1", "dw2", "dw3")]


def test_every_call_meets_the_kernels_contract(monkeypatch):
    bank, x, gy = _bank_and_data()
    calls = []
    _use_kernel(monkeypatch, _checked_kernel(calls))
    _run(bank, x, gy, torch.tensor(COUNTS))            # counts on the device: no host read
    T = sum(COUNTS)
    assert len(calls) == 6, calls                        # w1, w3, w2 forward; w2, w1, w3 dgrad
    assert (T, D) in [c[0] for c in calls] and (T, FF) in [c[0] for c in calls]
    for a_shape, b_shape, b_stride, sa, sb, offs_dtype in calls:
        assert sa == (T,) and sb == (E, b_shape[-1]) and offs_dtype == torch.int32
        assert b_stride[-2] == 1                         # column-major: the meta kernel checked it


def test_bank_equals_an_independent_per_expert_emulation(monkeypatch):
    bank, x, gy = _bank_and_data()
    _use_kernel(monkeypatch, _checked_kernel([]))
    got = _run(copy.deepcopy(bank), x, gy, COUNTS)
    ref = _reference(bank, x, gy)
    for name, g, r in zip(["y", "dx", "dw1", "dw2", "dw3"], got, ref):
        assert max_rel_err(g, r) <= 2 ** -7, (name, max_rel_err(g, r))
    bf = copy.deepcopy(bank)
    bf.fp8 = False                                       # the same bank unquantized, in fp32
    exact = _run(bf, x, gy, COUNTS)
    for name, g, r in zip(["y", "dx"], got, exact):
        assert max_rel_err(g, r) <= 2 ** -3, (name, max_rel_err(g, r))

    def swapped(a, b, scale_a, scale_b, offs, out_dtype):  # a scale over the wrong dim
        return rw.emulated_scaled_grouped_mm(a, b, scale_a.flip(0), scale_b.flip(-1), offs, out_dtype)
    _use_kernel(monkeypatch, _checked_kernel([], swapped))
    wrong = _run(copy.deepcopy(bank), x, gy, COUNTS)
    assert max_rel_err(wrong[0], ref[0]) > 0.1


def test_the_device_path_reads_no_counts_on_the_host(monkeypatch):
    """With the counts on the device, the bank's own code never reads them (the emulated
    kernel, a CPU stand-in, does): a kernel that returns zeros makes no host read at all."""
    bank, x, gy = _bank_and_data()
    reads = []
    _use_kernel(monkeypatch, lambda a, b, sa, sb, offs=None, out_dtype=None:
                a.new_zeros(a.shape[0], b.shape[-1], dtype=out_dtype))
    orig = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or orig(t))
    _run(bank, x, gy, torch.tensor(COUNTS))
    assert reads == []


@pytest.mark.parametrize("K, N, rows, compiled, pays", [
    (2048, 768, 16384, True, False),     # Qwen3-30B-A3B's experts
    (2048, 2048, 16384, False, False),
    (6144, 16384, 32768, True, True),    # Mixtral-8x22B's, compiled, 32k rows an expert
    (6144, 16384, 4096, True, False),    # ... with fewer rows the weights' quantization dominates
    (6144, 16384, 32768, False, False),  # eager quantization costs more than FP8 saves
])
def test_the_cost_model_keeps_small_shapes_in_bf16(K, N, rows, compiled, pays):
    ok, why = rw.rowwise_pays(K, N, rows, compiled)
    assert ok is pays, why
    assert why.startswith(f"[{K} x {N}]: FP8 saves ")


def test_a_real_kernel_keeps_what_cannot_gain_in_bf16(monkeypatch):
    bank, x, gy = _bank_and_data()
    bank.set_fp8(True, "rowwise")
    calls = []
    _use_kernel(monkeypatch, _checked_kernel(calls))
    assert bank.fp8_choice(len(x), real_kernel=True, compiled=False)[0] == (False, False, False)
    assert bank.fp8_choice(len(x), real_kernel=False, compiled=False)[0] == (True, True, True)
    y = _run(bank, x, gy, COUNTS)[0]
    assert calls == [] and torch.isfinite(y).all()     # every GEMM ran bf16


def test_train_py_says_which_gemms_stay_bf16(monkeypatch):
    """The run's first lines (trainer/run.py, parallel/fp8.py fp8_lines): on a GPU with the
    kernels, one line per bank projection and per Linear shape, each with the model's figures,
    and the Linears that cannot gain left nn.Linear; on this CPU, all emulated."""
    import parallel.fp8 as pf
    from trainer.config import load_config
    from trainer.model import build_model
    cfg = load_config(None, ["model.d_model=2048", "moe.d_ff=768", "moe.num_experts=64", "moe.top_k=8",
                             "model.n_layers=2", "moe.every=2", "model.d_ff=8192", "model.n_heads=16"])
    model = build_model(cfg, torch.device("meta"))
    pf.apply_fp8(model, "rowwise", rows=16384, compiled=True)
    assert pf.fp8_lines(model, 16384, torch.device("cpu"), True) == [
        "fp8 rowwise: every expert-bank GEMM emulated on cpu (the tests' reference; "
        "torch._scaled_grouped_mm runs on CUDA SM90+)",
        "fp8: the blocks' Linears emulated on cpu (FP8 matmuls need CUDA compute capability 8.9+)"]
    monkeypatch.setattr(pf, "device_fp8_kernels", lambda device: FP8Kernels(True, False, True))
    model = build_model(cfg, torch.device("meta"))
    pf.apply_fp8(model, "rowwise", rows=16384, compiled=True)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    lines = pf.fp8_lines(model, 16384, torch.device("cuda"), True)
    banks = [ln for ln in lines if ln.startswith("fp8 rowwise: ")]
    assert len(banks) == 4 and all(ln.startswith("fp8 rowwise: stays bf16 [") for ln in banks), lines
    assert "[2048 x 768]: FP8 saves 0.81 ns a row" in banks[2] and "2048 rows an expert" in banks[2]
    assert "16384 rows an expert" in banks[0]          # the dense FFN: every token
    assert "fp8 Linear: stays bf16 [2048 x 2048]: FP8 saves " in "\n".join(lines)
    assert all(ln.endswith("(compiled, 16384 rows a micro-batch)") for ln in lines if "Linear" in ln)
