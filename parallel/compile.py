"""parallel.compile: torch.compile per block, in regions that capture whole.

A block whose MoE layers route on this rank (LocalDispatcher: the grouped GEMMs take the
counts on the device) has no host sync in its forward or backward and compiles as one graph
(fullgraph=True, so a break raises instead of silently splitting it). A block whose MoE layer
exchanges tokens with other ranks (expert parallelism, expert tensor parallelism) sends
row counts that the all-to-all needs on the host; there the exchange stays eager and the
regions around it compile whole: every child of the block but the MoE layer (norms,
attention), and inside that layer the router (scores, top-k, the losses' statistics) and the
shared experts. The regions' boundaries are module calls, not graph breaks: each region is
one graph, and a new routing changes no shape (dropless: T*K rows), so nothing recompiles.

Compiled modules keep their parameters (their forward is replaced, not the module), so state
dicts, ZeRO and checkpoints see the same names as eager.
"""
import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from models import blocks
from moe import MoELayer
from moe.dispatcher import LocalDispatcher


def exchanges_on_host(layer: MoELayer) -> bool:
    """The layer sends tokens to other ranks (its all-to-all's split sizes are host ints)."""
    return layer.etp_group is not None or (layer.ep_group is not None
                                           and not isinstance(layer.dispatcher, LocalDispatcher))


def regions(block: nn.Module) -> list:
    """The modules parallel.compile compiles for this block, each as one graph. A block whose
    norms' outputs are recomputed (parallel/output_recompute.py) keeps its own forward and the
    norms eager: its saved-tensor hooks and the norms' notes are not traceable, so its other
    children compile, each whole, and their graphs' saved tensors meet the hooks."""
    exchanging = [m for m in block.modules() if isinstance(m, MoELayer) and exchanges_on_host(m)]
    eager = getattr(block, "outputs_recomputed", ())
    if not exchanging and not eager:
        return [block]
    out = []
    for layer in exchanging:
        out += [m for m in (layer.router, layer.shared_experts) if m is not None]
    for child in block.children():
        if any(child is m for m in eager):
            continue
        if not any(c is layer for c in child.modules() for layer in exchanging):
            out.append(child)
    return out


def compile_forward(module: nn.Module, backend: str = "inductor") -> None:
    """module.forward compiled as one graph. The module's hooks stay outside it (FSDP2's
    gathers, the gradient-sync hooks), and so do the trainer's dispatch-mode counters (the
    communication ledger, the CPU live-tensor peak, strict collectives): torch.compile cannot
    trace under a Python dispatch mode, and a graph holds no collective for them to count."""
    graph = torch.compile(module.forward, fullgraph=True, backend=backend)

    def forward(*args, **kwargs):
        with _disable_current_modes():
            return graph(*args, **kwargs)
    module.forward = forward


def compile_blocks(model: nn.Module, backend: str = "inductor") -> list:
    """Compile each block's regions (fullgraph); returns the modules compiled."""
    done = []
    for b in blocks(model):
        for m in regions(b):
            compile_forward(m, backend)
            done.append(m)
    return done


def auto_compile(plan, device_type: str, hf_model: bool) -> tuple:
    """(on, why) for parallel.compile=auto: on for CUDA runs of the layouts compile is tested
    with (tests/dist/test_compile_layouts.py, tests/e2e/test_compile_train.py: fp32, bf16 and
    fp8, whose Float8Linears torchao needs compiled for its speed); a CPU run stays
    eager (inductor's C++ build costs more than it saves on a laptop)."""
    if device_type != "cuda":
        return False, f"eager on {device_type} (parallel.compile=true compiles anyway)"
    untested = [f"{name}={value}" for name, value, off in (
        ("pp", plan.pp, 1), ("cp", plan.cp, 1), ("tp", plan.tp, 1), ("etp", plan.etp, 1),
        ("ps_servers", plan.ps_servers, 0), ("a2a_overlap", plan.a2a_overlap, "none"),
        ("recompute", plan.recompute, "none")) if value != off]
    if plan.precision not in ("fp32", "bf16", "fp8"):
        untested.append(f"precision={plan.precision}")
    if hf_model:
        untested.append("a Hugging Face model")
    if untested:
        return False, f"eager: not tested compiled with {', '.join(untested)} (parallel.compile=true compiles anyway)"
    return True, "each block compiled, in regions that capture whole (parallel/compile.py)"
