"""Expert tensor parallelism (parallel.etp): every expert's d_ff split over etp ranks.

At world 4, for each layout: the same weights and global batch as one process give
  outputs   the logits of this rank's share of the batch            within 2e-6 absolute
  gradients every parameter after one backward (after the layout's    within 1e-6 absolute +
            gradient sync), an expert's compared on this rank's block   1e-4 relative
            of it (ep block of experts, etp block of d_ff); not under
            ZeRO-2, whose sync leaves flat slices
  training  5 AdamW steps with global-norm clipping: loss and grad   the dense matrix's
            norm per step (tests/dist/dense_common.py)                  2e-5 / 1e-4
and the ledger books the d_ff-slice exchanges as expert_tensor_parallel. fp32 throughout:
the layouts only reorder sums (the n partial outputs of a row are added in rank order).
The loop and grouped_mm expert paths are both run.
"""
import pytest

from moe.aux import collect_aux_loss, moe_layers
from moe.expert_tp import FFN_DIMS, ffn_block
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
OUT_ATOL, GRAD_ATOL, GRAD_RTOL, ATOL, RTOL = 2e-6, 1e-6, 1e-4, 2e-5, 1e-4

LAYOUTS = [  # (name, ParallelPlan fields, experts_impl)
    ("dp4_ep2_etp2", dict(dp=4, ep=2, etp=2), "loop"),
    ("dp4_etp4", dict(dp=4, etp=4), "grouped_mm"),
    ("dp4_etp2_zero1", dict(dp=4, etp=2, zero=1), "loop"),
    ("dp4_etp2_zero2", dict(dp=4, etp=2, zero=2), "grouped_mm"),
    ("dp2_tp2_ep2_etp2", dict(dp=2, tp=2, ep=2, etp=2), "grouped_mm"),
]


def _configs(impl):
    model_cfg, moe_cfg = dc.configs()
    moe_cfg.experts_impl = impl
    return model_cfg, moe_cfg


def _reference(model_cfg, moe_cfg):
    """Logits and every gradient of one process on the global batch of step 0."""
    model = dc.make_model(model_cfg, moe_cfg)
    x, y = dc.batch(0, model_cfg.vocab_size)
    logits = model(x)
    (dc.task_loss(logits, y) + collect_aux_loss(model)).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _my_block(name, ref_grad, meshes, plan):
    """This rank's part of a one-process gradient: experts [r*L, (r+1)*L) of the ep group,
    d_ff block j of the etp group; everything else whole."""
    if ".experts." not in name:
        return ref_grad
    L = ref_grad.shape[0] // plan.ep
    r, j = meshes.rank("ep"), meshes.rank("etp")
    block = ref_grad[r * L:(r + 1) * L]
    pname = name.rpartition(".")[2]
    return ffn_block(block, pname, j, plan.etp) if pname in FFN_DIMS else block


def _one_step_check(world, spec, model_cfg, moe_cfg):
    """(max |logit diff|, [(name, max |grad diff|, bound)], expert_tensor_parallel bytes)."""
    from parallel.apply import parallelize
    from parallel.dtensors import local
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    ref_logits, ref_grads = _reference(model_cfg, moe_cfg)
    plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, dc.B)
    meshes = build_meshes(plan)
    par = parallelize(dc.make_model(model_cfg, moe_cfg), plan, meshes, loss_fn=dc.task_loss)
    dp_rank, n = meshes.rank("dp"), dc.B // plan.dp
    x, y = dc.batch(0, model_cfg.vocab_size)
    x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
    with par.recording_comm():
        logits = par.model(x)
        (dc.task_loss(logits, y) + collect_aux_loss(par.model)).backward()
    comm = par.ledger.take()
    mine = ref_logits[dp_rank * n:(dp_rank + 1) * n]
    out_diff = (local(logits.full_tensor() if hasattr(logits, "full_tensor") else logits) - mine).abs().max().item()
    grads = []
    assert {n for n, _ in par.model.named_parameters()} == set(ref_grads)  # every gradient
    for name, p in par.model.named_parameters():
        if plan.zero == 2:
            break  # reduce-scattered into flat slices: the 5 steps below check them
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = _my_block(name, ref_grads[name], meshes, plan)
        assert g.shape == want.shape, (name, tuple(g.shape), tuple(want.shape))
        grads.append((name, (g - want).abs().max().item(),
                      GRAD_ATOL + GRAD_RTOL * want.abs().max().item()))
    assert all(layer.etp_group is not None for _, layer in moe_layers(par.model))
    return out_diff, grads, comm.get("expert_tensor_parallel", 0)


def _worker(rank, world, layouts):
    out = {}
    for name, spec, impl in layouts:
        model_cfg, moe_cfg = _configs(impl)
        out[name] = (_one_step_check(world, spec, model_cfg, moe_cfg),
                     dc.train_layout(world, spec, model_cfg, moe_cfg))
    return out


@pytest.mark.long
def test_expert_tensor_parallel_equals_one_process_world4():
    refs = {impl: dc.reference_run(*_configs(impl)) for impl in {i for _, _, i in LAYOUTS}}
    results = run_distributed(_worker, 4, LAYOUTS, timeout=400)
    for name, _, impl in LAYOUTS:
        for rank, rank_out in enumerate(results):
            (out_diff, grads, etp_bytes), losses = rank_out[name]
            assert out_diff <= OUT_ATOL, f"{name} rank {rank}: logits differ by {out_diff:.2e}"
            bad = [(n, f"{d:.2e} > {b:.2e}") for n, d, b in grads if d > b]
            assert not bad, f"{name} rank {rank}: gradients differ: {bad}"
            assert etp_bytes > 0, f"{name} rank {rank}: no expert_tensor_parallel bytes booked"
            for step, ((l, g), (rl, rg)) in enumerate(zip(losses, refs[impl])):
                assert abs(l - rl) <= ATOL + RTOL * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
                assert abs(g - rg) <= ATOL + RTOL * abs(rg), f"{name} step {step}: norm {g} vs {rg}"
