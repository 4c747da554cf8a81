"""Multi-token prediction (models/mtp.py) under the layouts equals one process.

The default MoE GPT of dense_common (4 blocks, MoE in 1 and 3, so each MTP depth's block is
an MoE block too) with model.mtp_depth=1 (and once 2) trains 5 AdamW steps with global-norm
clipping on the same global batch under each layout and in one process. Per step the main
loss, each depth's MTP loss and the gradient norm, and at the end every parameter (this
rank's part: its experts under ep, its ZeRO-3 shard gathered) must agree.
fp64 throughout (tests/tolerance.py, rule 5): the layouts reorder sums only, so the bound
is 1e-9 relative on the losses and the norm and 1e-8 absolute on parameters of O(0.1) after
5 steps at lr 3e-3 (fp64's u is 1.1e-16: the bounds leave 7 orders for Adam's amplification).
Ring attention keeps its softmax statistics in fp32 (parallel/context/ring.py): the cp rows'
bound is fp32's, 2e-6 relative (30 u of fp32), on the per-step losses and norms, as
test_context_parallel.py checks cp; their parameters are not compared, since Adam turns an
fp32 rounding of a near-zero gradient into a step of up to lr (rule 5; measured: one expert
weight of 8192 off by 1.8e-6 after 5 steps). A shift that fetched the wrong tokens would move
the MTP losses at the first step by far more than the bound. A pipeline reports its losses
through fp32 (parallel/pipeline/runner.py): its rows take the cp bound on the reported
losses, and the fp64 bounds on the norm's and parameters' fp64 arithmetic.
Under cp the labels cross the cp ranks (the shift fetches the neighbour's first tokens) and
the masked last positions all sit on one rank; under tp the depths' norms and projection run
on the sequence shards; under pp the depths run on the last stage, reading the embedding
through the head it shares with the first stage (tied), and the schedule's loss carries them.
"""
import pytest
import torch
import torch.distributed as dist

from moe.aux import collect_aux_loss
from models.mtp import weighted_mtp_loss
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
RTOL, PARAM_ATOL = 1e-9, 1e-8
CP_RTOL = 2e-6

W2 = [("tp2", dict(tp=2), 1),
      ("cp2_ring", dict(cp=2), 1),
      ("cp2_ring_depth2", dict(cp=2), 2),
      ("dp2_zero3", dict(dp=2, zero=3), 1),
      ("dp2_ep2_zero1", dict(dp=2, ep=2, zero=1), 1),
      # recomputation reaches the depths' blocks (models.blocks.blocks lists them)
      ("dp2_ep2_recompute_full", dict(dp=2, ep=2, recompute="full"), 1),
      ("dp2_ep2_recompute_selective", dict(dp=2, ep=2, recompute="selective",
                                           recompute_modules="moe_act,experts,core_attn"), 2)]
W4 = [("tp2_dp2_ep2_depth2", dict(tp=2, dp=2, ep=2), 2),
      # the depths on the last stage, reading the embedding through the tied head
      ("pp2_1f1b", dict(pp=2, microbatches=2), 1),
      ("pp2_dp2_ep2_zero1_depth2", dict(pp=2, dp=2, ep=2, zero=1, microbatches=2), 2)]


def _configs(depth):
    model_cfg, moe_cfg = dc.configs()
    model_cfg.mtp_depth, model_cfg.mtp_loss_coef = depth, 0.3
    return model_cfg.validate(), moe_cfg


def _losses(model, x, y):
    """(total to back-propagate, [main, mtp_1, ...] detached)."""
    main = dc.task_loss(model(x, labels_BS=y), y)
    total, terms = weighted_mtp_loss(model)
    return main + collect_aux_loss(model) + total, torch.cat([main.detach().reshape(1), terms.detach()])


def _reference(depth):
    model = dc.make_model(*_configs(depth), dtype=torch.float64)
    opt = dc.adamw_of(model)
    out = []
    for step in range(dc.STEPS):
        loss, parts = _losses(model, *dc.batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), dc.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(parts.tolist() + [norm.item()])
    return out, {n: p.detach() for n, p in model.named_parameters()}


def _worker(rank, world, layouts):
    from parallel.apply import parallelize
    from parallel.dtensors import local
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    out = {}
    for name, spec, depth in layouts:
        model_cfg, moe_cfg = _configs(depth)
        plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, dc.B)
        meshes = build_meshes(plan)
        par = parallelize(dc.make_model(model_cfg, moe_cfg, dtype=torch.float64), plan, meshes,
                          loss_fn=dc.task_loss)
        opt = par.prepare_optimizer(dc.adamw_of(par.model))
        steps = []
        for step in range(dc.STEPS):
            x, y = dc.my_rows(par, *dc.batch(step))
            if plan.pp > 1:  # the schedule's forward and backward; the depths on the last stage
                total = par.pipeline_step(x, y)
                parts = torch.cat([(total - par.pipeline_aux_loss()).reshape(1), par.pipeline.mtp_terms()])
            else:
                loss, parts = _losses(par.model, x, y)
                loss.backward()
            norm = par.clip_grad_norm_(dc.CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(parts, group=meshes.group("dp"))  # the dp x cp replicas' parts
            steps.append((parts / plan.replicas).tolist() + [norm.item()])
        params = {}
        for n, p in par.model.named_parameters():
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            # a pipeline's last stage holds the tied embedding under the head's name
            params["tok_emb.weight" if n == "lm_head.weight" else n] = local(p).detach()
        out[name] = (steps, params, dict(ep=plan.ep, ep_rank=meshes.rank("ep")))
    return out


def _check(world, layouts, timeout):
    refs = {d: _reference(d) for d in {d for _, _, d in layouts}}
    results = run_distributed(_worker, world, layouts, timeout=timeout)
    for name, spec, depth in layouts:
        ref_steps, ref_params = refs[depth]
        cp = spec.get("cp", 1) > 1
        # a pipeline reports its losses through fp32 (runner.py), its training stays fp64
        rtol = CP_RTOL if cp or spec.get("pp", 1) > 1 else RTOL
        for rank, rank_out in enumerate(results):
            steps, params, ep = rank_out[name]
            assert len(steps[0]) == depth + 2, f"{name}: {steps[0]}"
            for step, (got, want) in enumerate(zip(steps, ref_steps)):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=0,
                                           msg=lambda m: f"{name} rank {rank} step {step}: {m}")
            if spec.get("pp", 1) == 1:
                assert set(params) == set(ref_params), f"{name}: {set(params) ^ set(ref_params)}"
            for n, p in ({} if cp else params).items():
                want = ref_params[n]
                if ".experts." in n and ep["ep"] > 1:  # this rank's experts
                    L = want.shape[0] // ep["ep"]
                    want = want[ep["ep_rank"] * L:(ep["ep_rank"] + 1) * L]
                torch.testing.assert_close(p, want, rtol=0, atol=PARAM_ATOL,
                                           msg=lambda m: f"{name} rank {rank} {n}: {m}")
        if spec.get("pp", 1) > 1:  # every parameter on some stage, the depths on the last
            held = set().union(*(set(r[name][1]) for r in results))
            assert held == set(ref_params), f"{name}: {held ^ set(ref_params)}"
            assert all(n.startswith("mtp.") is False for n in results[0][name][1]), name
        assert ref_steps[-1][1] < ref_steps[0][1], f"{name}: the MTP loss did not fall: {ref_steps}"


def test_mtp_two_ranks():
    _check(2, W2, timeout=240)


def test_mtp_four_ranks():
    _check(4, W4, timeout=300)
