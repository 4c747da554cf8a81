"""The planner's trace counts RMSNorm and narrow-value attention (MLA) as the GPU runs them
(parallel/planner/gpu_kernels.py): one fused kernel each way, not the CPU's decomposition.
The stand-ins compute the functions' values and gradients (against F.rms_norm and
F.scaled_dot_product_attention: fp64 1e-12, bf16 within one rounding), their census is two
ops moving exactly the fused kernels' tensors, and the planner's trace under bf16
parameters (parallel.param_dtype=bf16) counts no weight casts and a bf16 residual stream."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from moe.profiling.census import OpCensus
from parallel.planner.gpu_kernels import gpu_kernels
from parallel.planner.traced_bytes import step_bytes
from trainer.config import load_config
from trainer.planning import workload_from_config


@pytest.mark.parametrize("shape", [(2, 7, 32), (2, 4, 5, 16)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 2 ** -7)])
def test_the_stand_in_is_rms_norm(shape, dtype, tol):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = torch.randn(shape[-1], dtype=dtype, requires_grad=True)
    y0 = F.rms_norm(x, (shape[-1],), w, 1e-6)
    g = torch.randn_like(y0)
    d0 = torch.autograd.grad(y0, (x, w), g)
    with gpu_kernels():
        y1 = F.rms_norm(x, (shape[-1],), w, 1e-6)
    d1 = torch.autograd.grad(y1, (x, w), g)
    for a, b in zip((y0, *d0), (y1, *d1)):
        assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol * a.abs().max().item())


@pytest.mark.parametrize("causal", [True, False])
def test_the_attention_stand_in_is_sdpa(causal):
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 7, 12, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 7, 8, dtype=torch.float64, requires_grad=True)
    o0 = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    g = torch.randn_like(o0)
    with gpu_kernels(), OpCensus() as c:
        o1 = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        d1 = torch.autograd.grad(o1, (q, k, v), g)
    assert dict(c.by_op) == {"fused_attention": 1, "fused_attention_backward": 1}
    for a, b in zip((o0, *torch.autograd.grad(o0, (q, k, v), g)), (o1, *d1)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_the_attention_census_never_holds_the_scores():
    B, H, S, dqk, dv = 1, 4, 1024, 192, 128
    with FakeTensorMode():
        q, k = (torch.empty(B, H, S, dqk, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.empty(B, H, S, dv, dtype=torch.bfloat16, requires_grad=True)
        do = torch.empty(B, H, S, dv, dtype=torch.bfloat16)
        with gpu_kernels(), OpCensus() as fused:
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do)
    qk, vv, lse = B * H * S * dqk * 2, B * H * S * dv * 2, B * H * S * 4
    # forward q, k, v in, o, lse out; backward do, q, k, v, o, lse in, dq, dk, dv out
    assert fused.bytes == (2 * qk + vv + vv + lse) + (vv + 2 * qk + vv + vv + lse + 2 * qk + vv)


def test_what_it_cannot_fuse_stays_rms_norm():
    x = torch.randn(3, 8, dtype=torch.float64)
    w32 = torch.randn(8)
    with gpu_kernels(), OpCensus() as c:
        a = F.rms_norm(x, (8,), None, 1e-6)          # no weight
        b = F.rms_norm(x.float(), (8,), w32, 1e-6)    # same dtype: fused
    assert "fused_rms_norm" in c.by_op and c.by_op["fused_rms_norm"] == 1
    assert torch.equal(a, F.rms_norm(x, (8,), None, 1e-6))
    assert torch.equal(b, F.rms_norm(x.float(), (8,), w32, 1e-6))


def test_its_census_is_the_fused_kernels_tensors():
    T, D = 4096, 2048
    with FakeTensorMode():
        x = torch.empty(T, D, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(D, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.empty(T, D, dtype=torch.bfloat16)
        with OpCensus() as composite:
            torch.autograd.grad(F.rms_norm(x, (D,), w, 1e-6), (x, w), dy)
        with gpu_kernels(), OpCensus() as fused:
            torch.autograd.grad(F.rms_norm(x, (D,), w, 1e-6), (x, w), dy)
    assert dict(fused.by_op) == {"fused_rms_norm": 1, "fused_rms_norm_backward": 1}
    # forward: x, w in; y, rstd (fp32 [T, 1]) out. backward: dy, x, rstd, w in; dx, dw out
    TD, rstd = T * D * 2, T * 4
    assert fused.bytes == (TD + 2 * D + TD + rstd) + (TD + TD + rstd + 2 * D + TD + 2 * D)
    assert composite.bytes > 10 * fused.bytes   # what the CPU's decomposition moves instead


def test_bf16_parameters_trace_without_casts():
    cfg = load_config(None, ["model.n_layers=2", "model.qk_norm=true", "parallel.precision=bf16"])
    w = workload_from_config(cfg)
    fp32, bf16 = step_bytes(w, "bf16", "fp32"), step_bytes(w, "bf16", "bf16")
    block = (0, 0)
    assert fp32.units[block].per_step > 0 and bf16.units[block].per_step == 0  # no expert casts
    # nor the weights' casts per micro-batch (what stays: their first gradients, written)
    assert bf16.units[block].per_micro < fp32.units[block].per_micro / 5
    # the residual stream and the norms' inputs in bf16: fewer bytes per token
    assert bf16.units[block].per_token < 0.9 * fp32.units[block].per_token


def test_bf16_parameters_count_the_bytes_the_state_holds():
    """rank_bytes scales the per-micro-batch part by the rank's parameter bytes over the
    trace's: both in the held dtype (bf16: 2 bytes each), so one process's share is 1."""
    cfg = load_config(None, ["model.n_layers=2", "parallel.precision=bf16"])
    w = workload_from_config(cfg)
    fp32, bf16 = step_bytes(w, "bf16", "fp32"), step_bytes(w, "bf16", "bf16")
    assert bf16.param_bytes * 2 == fp32.param_bytes
