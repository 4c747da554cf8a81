"""The timing profile names every MoE phase of every layer and writes a readable trace."""
import io
import json

import torch

from moe import MoELayer
from moe.profiling import print_breakdown, trace_step


def test_trace_names_each_phase_per_layer_and_writes_chrome_trace(tmp_path):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(MoELayer(16, 32, 4, 2, num_shared_experts=1), MoELayer(16, 32, 4, 1))
    x = torch.randn(2, 8, 16)

    def step():
        y = layers(x)
        (y.square().mean() + sum(m.aux_loss for m in layers)).backward()

    calls = []
    result = trace_step(lambda: (calls.append(1), step()), tmp_path)
    assert len(calls) == 3 and (result["step"], result["warmup"]) == (3, 2)  # traced after warm-up
    assert result["untraced_ms"] > 0
    phases = result["phases"]
    for name in ("moe.router", "moe.dispatch", "moe.experts", "moe.combine"):
        assert phases[name]["calls"] == 2, name          # once per layer in the profiled step
        assert 0 < phases[name]["ms"] <= result["step_ms"]
    assert phases["moe.shared_experts"]["calls"] == 1
    assert "moe.all_to_all" not in phases                # no expert-parallel group here
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "moe.experts" for e in events)
    out = io.StringIO()
    print_breakdown(result, out)
    assert "moe.experts" in out.getvalue()
    assert out.getvalue().startswith("training step 3 after 2 warm-up steps: ")
