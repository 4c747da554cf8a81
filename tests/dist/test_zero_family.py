"""The ZeRO family against the unmodified layout and one process (tiny MoE GPT, fp32, 5 AdamW
steps on the global batch, as in test_dense_parallel.py).

ZeRO-Offload and hpZ change only where tensors live and which ranks gather them, so their
losses and grad norms meet the layout matrix's tolerance (2e-5 absolute / 1e-4 relative) and
their communication equals the layout without them. Placement is asserted on the host
buffers the optimizer steps (on this CPU-only machine the training device is the CPU too, so
the test checks they are separate tensors on the host device; on CUDA the same lines check
the real move).

qwZ and qgZ quantize to int8 blocks of 256 with an fp32 scale each (relative error per value
<= 1/254 of its block's max), so they are compared loosely: every step's loss within 1%
relative of one process, and the ledger's gather / reduce-scatter bytes <= 0.3x of the
unquantized layout's.
"""
import os

import pytest
import torch

from trainer.memory import model_state_bytes
from parallel.mesh import default_device_type
from parallel.data_parallel.offload import host_device
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
ATOL, RTOL, QUANT_RTOL = 2e-5, 1e-4, 1e-2


def _placement(par, opt) -> dict:
    """Where the optimizer's tensors live, read from them."""
    from parallel.dtensors import local
    model_ptrs = {local(p).data_ptr() for p in par.model.parameters()}
    stepped = [p for g in opt.param_groups for p in g["params"]]
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    tensors = [local(t) for t in stepped + state]
    return {"state_on_host": all(t.device == host_device() for t in tensors) and bool(state),
            "separate": not ({local(t).data_ptr() for t in state} & model_ptrs),
            "steps_model_params": {local(t).data_ptr() for t in stepped} <= model_ptrs,
            "params_on_host": all(local(p).device == host_device() for p in par.model.parameters()),
            "state_bytes": model_state_bytes(par.model, par.grads(), opt)["optimizer"]}


def _prefetch_lists(model) -> list:
    """[(forward, backward)] per FSDP2 block: how many units its gather prefetches."""
    from torch.distributed.fsdp import FSDPModule
    blocks = [b for b in model.blocks if isinstance(b, FSDPModule)] if hasattr(model, "blocks") else []
    return [(len(b._get_fsdp_state()._states_to_forward_prefetch),
             len(b._get_fsdp_state()._states_to_backward_prefetch)) for b in blocks]


def _worker(rank, world, layouts, env):
    os.environ.update(env)
    out = {}
    for name, spec in layouts:
        seen = {}

        def inspect(par, opt, step, comm):
            seen["comm"] = comm
            if par.ledger.multi_node:
                seen["inter"] = par.ledger.take_inter_node()
            if step == 0:
                seen["placement"] = _placement(par, opt)
                seen["prefetch"] = _prefetch_lists(par.model)
                if hasattr(par.zero, "units"):   # offload: the refresh copies cover every param once
                    ids = [id(p) for _, ps in par.zero.units for p in ps]
                    seen["units_cover"] = sorted(ids) == sorted(id(p) for p in par.zero.params)
        out[name] = {"losses": dc.train_layout(world, spec, *dc.configs(), inspect=inspect), **seen}
    return out


def _close(got, ref, atol, rtol):
    return all(abs(g - r) <= atol + rtol * abs(r) for g, r in zip(got, ref))


OFFLOAD = [("zero1_off", dict(dp=2, zero=1, offload="optimizer"), "zero1"),
           ("zero2_off", dict(dp=2, zero=2, offload="optimizer"), "zero2"),
           ("zero3_off", dict(dp=2, zero=3, offload="optimizer"), "zero3"),
           ("zero3_params", dict(dp=2, zero=3, offload="params"), "zero3"),
           ("ep2_zero2_off", dict(dp=2, ep=2, zero=2, offload="optimizer"), "ep2_zero2"),
           ("ep2_zero3_off", dict(dp=2, ep=2, zero=3, offload="optimizer"), "ep2_zero3")]
BASE = [("zero1", dict(dp=2, zero=1)), ("zero2", dict(dp=2, zero=2)), ("zero3", dict(dp=2, zero=3)),
        ("ep2_zero2", dict(dp=2, ep=2, zero=2)), ("ep2_zero3", dict(dp=2, ep=2, zero=3))]
QUANT = [("qwz", dict(dp=2, zero=3, zeropp_quantize_weights=True), "zero3", "zero_param_gather"),
         ("qgz3", dict(dp=2, zero=3, zeropp_quantize_grads=True), "zero3", "zero_grad_reduce_scatter"),
         ("qgz2", dict(dp=2, zero=2, zeropp_quantize_grads=True), "zero2", "zero_grad_reduce_scatter"),
         ("ep2_qwz_qgz_off", dict(dp=2, ep=2, zero=3, offload="optimizer", zeropp_quantize_weights=True,
                                  zeropp_quantize_grads=True), "ep2_zero3", "zero_param_gather")]


@pytest.mark.long
def test_world2_offload_and_quantized_collectives():
    layouts = BASE + [(n, s) for n, s, _ in OFFLOAD] + [(n, s) for n, s, _, _ in QUANT]
    ref = [loss for loss, _ in dc.reference_run(*dc.configs())]
    ref_norms = [n for _, n in dc.reference_run(*dc.configs())]
    for rank_out in run_distributed(_worker, 2, layouts, {}, timeout=400):
        for name, _, base in OFFLOAD:
            got = rank_out[name]
            assert _close([l for l, _ in got["losses"]], ref, ATOL, RTOL), (name, got["losses"], ref)
            assert _close([n for _, n in got["losses"]], ref_norms, ATOL, RTOL), name
            assert got["comm"] == rank_out[base]["comm"], (name, got["comm"], rank_out[base]["comm"])
            where = got["placement"]
            assert where["state_on_host"] and where["separate"], (name, where)
            # offload=optimizer steps host masters; offload=params steps FSDP2's host shards
            assert where["steps_model_params"] == (name == "zero3_params"), (name, where)
            assert set(where["state_bytes"]) == {host_device().type}, (name, where)
            on_cpu = default_device_type() == "cpu"  # the training device is the host here
            assert where["params_on_host"] == (name == "zero3_params" or on_cpu), (name, where)
        for name, _, base, kind in QUANT:
            got = rank_out[name]
            assert _close([l for l, _ in got["losses"]], ref, 0.0, QUANT_RTOL), (name, got["losses"], ref)
            ratio = got["comm"][kind] / rank_out[base]["comm"][kind]
            assert ratio <= 0.3, (name, kind, ratio)
        both = rank_out["ep2_qwz_qgz_off"]["comm"]
        assert both["zero_grad_reduce_scatter"] <= 0.3 * rank_out["ep2_zero3"]["comm"]["zero_grad_reduce_scatter"]
        assert both["expert_all_to_all"] > 0  # (its size follows the routing, which int8 weights move)


def test_world4_hpz_keeps_backward_gathers_in_the_node_and_prefetch():
    """dp=4 as 2 nodes x 2 ranks (LOCAL_WORLD_SIZE=2 tells the ledger, as torchrun would):
    hpZ computes the same, and the gather bytes that cross nodes drop. zero_prefetch=2
    (with ep=2: the MoE blocks hold expert and router units) computes the same, moves the
    same bytes, and every block's gather really prefetches the next two blocks' units."""
    layouts = [("zero3", dict(dp=4, zero=3)), ("hpz2", dict(dp=4, zero=3, zeropp_hpz=2)),
               ("prefetch2", dict(dp=4, zero=3, zero_prefetch=2)),
               ("ep2_zero3", dict(dp=4, ep=2, zero=3)),
               ("ep2_prefetch2", dict(dp=4, ep=2, zero=3, zero_prefetch=2)),
               ("ep2_prefetch2_off", dict(dp=4, ep=2, zero=3, zero_prefetch=2, offload="optimizer"))]
    ref = dc.reference_run(*dc.configs())
    for rank_out in run_distributed(_worker, 4, layouts, {"LOCAL_WORLD_SIZE": "2"}, timeout=300):
        base, hpz = rank_out["zero3"], rank_out["hpz2"]
        assert rank_out["ep2_prefetch2_off"]["units_cover"]
        for name, plain in (("prefetch2", "zero3"), ("ep2_prefetch2", "ep2_zero3"),
                            ("ep2_prefetch2_off", "ep2_zero3")):
            got = rank_out[name]
            assert _close([l for l, _ in got["losses"]], [l for l, _ in ref], ATOL, RTOL), name
            assert got["comm"] == rank_out[plain]["comm"], (name, got["comm"], rank_out[plain]["comm"])
            fwd = [f for f, _ in got["prefetch"]]
            bwd = [b for _, b in got["prefetch"]]
            assert len(fwd) >= 3 and all(f >= 2 for f in fwd[:-2]) and fwd[-1] == 0, (name, got["prefetch"])
            assert bwd[0] == 0 and all(b >= 2 for b in bwd[2:]), (name, got["prefetch"])
            assert rank_out[plain]["prefetch"] == [(0, 0)] * len(fwd), rank_out[plain]["prefetch"]
        for got in (base, hpz):
            assert _close([l for l, _ in got["losses"]], [l for l, _ in ref], ATOL, RTOL)
            assert _close([n for _, n in got["losses"]], [n for _, n in ref], ATOL, RTOL)
        inter = hpz["inter"]["zero_param_gather"] / base["inter"]["zero_param_gather"]
        assert inter < 0.75, (hpz["inter"], base["inter"])
        assert hpz["comm"]["zero_param_gather"] > base["comm"]["zero_param_gather"]  # intra-node copies
        assert hpz["comm"]["zero_grad_reduce_scatter"] == base["comm"]["zero_grad_reduce_scatter"]
