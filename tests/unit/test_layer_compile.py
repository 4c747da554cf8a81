"""The one-process dropless layer captures as one graph (torch.compile fullgraph=True, so any
graph break raises) and is not recompiled for new routings: three batches with different
routings, one graph; with the gates in the experts (moe.gates_in_experts) too. Dynamo's capture is what breaks on host syncs; the eager backend keeps
the test fast (inductor's code generation does not add or remove breaks)."""
import pytest
import torch
from torch._dynamo.utils import counters

from moe import MoELayer


@pytest.mark.parametrize("gated", [False, True], ids=["weighted_combine", "gates_in_experts"])
def test_dropless_layer_compiles_fullgraph_without_recompiles(gated):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    kw = dict(experts_impl="grouped_mm", gates_in_experts=gated)
    layer = MoELayer(64, 128, 8, 2, None, "swiglu", **kw).bfloat16()
    ref = MoELayer(64, 128, 8, 2, None, "swiglu", **kw).bfloat16()
    ref.load_state_dict(layer.state_dict())
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    routings = []
    for _ in range(3):
        x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
        xc, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y = compiled(xc)
        y.sum().backward()
        ref(xr).sum().backward()
        torch.testing.assert_close(y, ref(xr.detach()), rtol=0, atol=0)
        torch.testing.assert_close(xc.grad, xr.grad, rtol=0, atol=0)
        routings.append(layer.last_stats.kept_E.clone())
    assert not torch.equal(routings[0], routings[1])  # the routings did change
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_every_block_of_the_default_gpt_compiles_fullgraph():
    """parallel.compile compiles each block (parallel/apply.py); under bf16 autocast with the
    grouped GEMM experts (what experts_impl=auto takes on a GPU; the CPU's auto takes the
    per-expert loop, which reads its counts on the host) every block captures as one graph,
    forward and backward, for two batches, one graph per kind of block."""
    from models import blocks
    from models.build import build_model
    from models.config import ModelConfig, MoEConfig
    from parallel.precision import apply_precision

    torch._dynamo.reset()
    counters.clear()
    model = build_model(ModelConfig(), MoEConfig(experts_impl="grouped_mm"), device="cpu")
    apply_precision(model, "bf16")
    stack = blocks(model)
    for b in stack:
        b.compile(fullgraph=True, backend="eager")
    for seed in range(2):
        ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(seed))
        out = model(ids)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    # every block captured, and blocks of one kind (the dense ones, the MoE ones) share one
    # graph: nothing guards on which block's weights run (tests/unit/test_compile_plan.py)
    kinds = {type(b.ffn).__name__ for b in stack}
    assert len(stack) == 4 and counters["stats"]["unique_graphs"] == len(kinds) == 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()
