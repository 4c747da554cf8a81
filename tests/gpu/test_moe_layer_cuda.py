"""The MoE layer on CUDA equals the CPU reference, for both expert paths and both dtypes.

Same weights, dtype and input on CPU (experts_impl loop, the reference) and on CUDA
(experts_impl loop / grouped_mm / auto); output, input gradient and every parameter gradient
compared. The reference runs in the same dtype: a bf16 layer routes from bf16 router logits,
and against an fp32 layer some tokens pick other experts (measured on an H200: router and
expert gradients 0.24-0.51 relative apart, identically on CPU and CUDA), which is bf16's
doing, not the device's.
Tolerances: fp32 max |diff| <= 1e-4 * max |ref| (TF32 is off; GPU reductions reorder sums);
bf16 <= 3e-2 * max |ref| (8-bit mantissa over D- and F-length sums).
"""
import copy

import pytest
import torch

from moe import MoELayer
from moe.grouped_mm import resolve_impl, unsupported_reason
from tests.tolerance import max_rel_err

D, F, E, K = 64, 128, 8, 2
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
pytestmark = pytest.mark.usefixtures("no_tf32")


@pytest.mark.parametrize("impl", ["loop", "grouped_mm", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cf", [None, 1.25])
@pytest.mark.parametrize("gated", [False, True], ids=["combine_gates", "gates_in_experts"])
def test_layer_on_cuda_matches_cpu(impl, dtype, cf, gated):
    """The CUDA layer (with the gates in the experts: moekit's fused weighted activation, one
    compiled kernel each way) against the CPU loop layer that weighs in the combine."""
    dev = torch.device("cuda")
    if impl == "grouped_mm" and unsupported_reason(dev, dtype, D, F):
        with pytest.raises(ValueError, match="experts_impl='grouped_mm' cannot run here"):
            resolve_impl("grouped_mm", dev, dtype, D, F)
        return
    torch.manual_seed(0)
    ref = MoELayer(D, F, E, top_k=K, capacity_factor=cf, activation="swiglu", experts_impl="loop")
    gpu = copy.deepcopy(ref)
    gpu.experts.experts_impl = impl
    gpu.gates_in_experts = gated
    gpu = gpu.to(dev, dtype)
    ref = ref.to(dtype)
    x = torch.randn(4, 32, D).to(dtype)
    gy = torch.randn(4, 32, D).to(dtype)
    xr = x.clone().requires_grad_()
    (ref(xr) * gy).sum().backward()
    xg = x.to(dev, dtype).requires_grad_()
    yg = gpu(xg)
    (yg * gy.to(dev, dtype)).sum().backward()
    tol = TOL[dtype]
    assert yg.dtype == dtype and yg.device.type == "cuda"
    with torch.no_grad():
        assert max_rel_err(yg, ref(x)) <= tol
    assert max_rel_err(xg.grad, xr.grad) <= tol
    for (name, p_ref), (_, p_gpu) in zip(ref.named_parameters(), gpu.named_parameters()):
        assert max_rel_err(p_gpu.grad, p_ref.grad) <= tol, name
    took = gpu.experts.impl_for(xg.detach())
    assert took in ("loop", "grouped_mm")
    if impl == "auto":
        want = "loop" if unsupported_reason(dev, dtype, D, F) else "grouped_mm"  # never the loop on CUDA
        assert took == want, (took, want)


def test_explicit_grouped_mm_with_bad_alignment_fails_in_one_line():
    with pytest.raises(ValueError) as e:
        resolve_impl("grouped_mm", torch.device("cuda"), torch.bfloat16, 60, 128)
    assert "\n" not in str(e.value) and "multiple of 16" in str(e.value)


def test_cpu_peak_counter_agrees_with_the_cuda_allocator():
    """trainer/memory.py counts live tensor bytes by dispatch on CPU (no allocator
    statistics there). On CUDA the same counter, run on the same step, must agree with the
    allocator's own torch.cuda.max_memory_allocated within 10% (the allocator rounds blocks
    up to 512 bytes and sees library workspaces the counter does not)."""
    from trainer.memory import _LiveBytes, _Tracker
    torch.manual_seed(0)
    layer = MoELayer(256, 1024, E, top_k=K, activation="swiglu").cuda()
    x = torch.randn(8, 256, 256, device="cuda")

    def step():
        layer(x).square().mean().backward()
        layer.zero_grad(set_to_none=True)
    step()   # warm: the caching allocator and cuBLAS workspaces exist before measuring
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    counter = _LiveBytes()
    with _Tracker(counter):
        step()
    torch.cuda.synchronize()
    allocator = torch.cuda.max_memory_allocated()
    counted = before + counter.peak
    assert abs(counted - allocator) <= 0.10 * allocator, (counted, allocator)


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=1.25), dict(router="expert_choice"),
                                dict(score_func="sigmoid"), dict(gates_in_experts=True)],
                         ids=["dropless", "capacity", "expert_choice", "sigmoid", "gates_in_experts"])
def test_one_process_layer_never_waits_for_the_gpu(kw):
    """bf16 grouped_mm layer forward+backward under torch.cuda.set_sync_debug_mode("error"):
    any host sync (an .item(), a nonzero, a copy to the host) raises."""
    kw = dict(kw)
    cf = kw.pop("capacity_factor", None)
    layer = MoELayer(256, 512, 16, 2, cf, "swiglu", experts_impl="grouped_mm", **kw).to(
        device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()  # warm: the fused activation compiles on its first call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).backward(torch.ones_like(x))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_fused_ops_on_cuda_match_cpu(score_func):
    """moe/router_ops.py on CUDA (the fp32-output GEMM, the compiled score kernel) against
    their CPU arithmetic: fp32 logits from bf16 operands (only the summation order differs:
    1e-5 relative), the backward's bf16-rounded logit gradient (2^-8 relative per element)."""
    from moe.router_ops import router_logits, score_stats
    torch.manual_seed(0)
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    w = (torch.randn(16, 256) * 0.05).to(torch.bfloat16)
    g = torch.randn(512, 16)
    out = {}
    for dev in ("cpu", "cuda"):
        xl = x.to(dev).requires_grad_(True)
        wl = w.to(dev).requires_grad_(True)
        logits = router_logits(xl, wl)
        scores, z, ent = score_stats(logits, score_func)
        ((scores * g.to(dev)).sum() + z).backward()
        out[dev] = [t.detach().cpu().float() for t in (logits, scores, z, ent, xl.grad, wl.grad)]
    assert out["cuda"][0].dtype == torch.float32
    for name, a, b, tol in zip(("logits", "scores", "z", "entropy", "dx", "dw"), out["cpu"],
                               out["cuda"], (1e-5, 1e-5, 1e-5, 1e-5, 1e-2, 1e-2)):
        assert max_rel_err(b, a) <= tol, name


def test_baton_times_the_streams_stall_not_the_host():
    """Under NCCL work.wait() only makes the stream wait: parallel/interleave.py's Baton times
    that stall with CUDA events. An exchange stood in for by a side-stream sleep (~50 ms)
    that the current stream waits for: the host returns at once, the stall is counted."""
    import time
    from parallel.interleave import Baton
    side, done = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # cycles: ~50 ms at ~2 GHz
        done.record(side)

    class Work:
        def wait(self):
            torch.cuda.current_stream().wait_event(done)
    baton = Baton()
    t0 = time.perf_counter()
    baton.wait(Work())
    host_s = time.perf_counter() - t0
    got = baton.take()
    assert host_s < 0.01 and got["a2a_exposed_s"] > 0.02, (host_s, got)
