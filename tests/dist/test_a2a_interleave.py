"""parallel.a2a_overlap=1f1b (parallel/interleave.py) equals the plain micro-batch loop.

Each layout trains the tiny MoE GPT for 5 AdamW steps of M micro-batches per rank (4, or 2
where tensor parallelism needs 2 sequences per micro-batch or the rank has 2 rows), once
with the micro-batches one after the other and once with the forward of micro-batch i+1
beside the backward of micro-batch i (switching at every expert all-to-all). Each
micro-batch runs the same operations in the same order either way and the backwards keep
their order, so the runs must agree exactly: losses, gradient norms and every parameter
after 5 steps, bit for bit (tolerance 0). The plain loop itself equals one process
(tests/dist/test_expert_parallel.py and the others). Also checked: the baton really
switched (the forward handed over at its exchanges) and every exchange was waited for
through it (4 per MoE layer and micro-batch: dispatch, combine and their backward; two
hops each under the hierarchical dispatch, plus the gates).

Randomness: dropout 0.1 and router jitter 0.01 with full and with selective recomputation
(the recompute restores the forward's generator state while the other micro-batch's forward
draws between its pieces: parallel/interleave.py keeps one state per micro-batch), both
runs seeded alike. The communication ledger counts the same bytes as for the plain loop (the
helper thread runs inside the caller's dispatch modes), from step 1 (a pipeline's step 0 also
runs torch's shape inference) and except ZeRO-3's parameter gathers, which the overlap makes
once per step (it holds the gathered weights across the pairs). By kind: the ledger's label
is per thread (parallel/ledger.py), so the helper thread's tensor-parallel collectives are
not filed under a label the other thread holds at that moment.

Layouts: world 2 dp2 x ep2 under ZeRO 0/1/2/3, with bf16 and the hierarchical dispatch on
2 declared nodes, with full recomputation, with dropout and jitter under full and selective
recomputation; world 4 tp2 x dp2 x ep2 (ZeRO-1) and dp4 x ep2
x etp2; world 8 dp4 x cp2 x ep4 with ZeRO-3, bf16 and the hierarchical dispatch on 2 nodes.
Inside the pipeline schedules (parallel/pipeline/paired_steps.py: the schedule's neighbouring
forward/backward pairs run interleaved), against the same schedule without the overlap:
world 4 pp2 x dp2 x ep2 with 4 micro-batches under dualpipev, zbv, zbv with ZeRO-2 and
dualpipev with ZeRO-1 and bf16; world 8 pp2 x tp2 x dp2 x ep4 dualpipev with ZeRO-1, bf16 and
the hierarchical dispatch (the 1F1B family's pairs are refused: parallel/plan.py; the V schedules
take neither cp nor ZeRO-3).
A pipeline's waits are counted from step 1 (step 0 also runs torch's shape-inference
forward).
"""
import functools

import pytest
import torch

from moe.aux import collect_aux_loss, moe_layers
from parallel.interleave import run_interleaved
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
STEPS = 5


def _train(world, spec, overlap, moe_extra, M):
    from parallel.apply import parallelize
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    # the V schedules refuse a tied embedding (plan.py); the others keep it, across stages
    model_cfg, moe_cfg = dc.configs(tie=spec.get("pp_schedule") not in ("zbv", "dualpipev"))
    for k, v in moe_extra.items():
        setattr(model_cfg if k == "dropout" else moe_cfg, k, v)
    plan = ParallelPlan(**spec, a2a_overlap=overlap).validate(world, model_cfg, moe_cfg, dc.B)
    par = parallelize(dc.make_model(model_cfg, moe_cfg), plan, build_meshes(plan), loss_fn=dc.task_loss)
    opt = par.prepare_optimizer(dc.adamw_of(par.model))
    out, switches, comm = [], None, {}
    torch.manual_seed(1234)   # dropout and jitter draw alike in both runs
    for step in range(STEPS):
        x, y = dc.my_rows(par, *dc.batch(step))
        losses = []
        with par.ledger.recording():
            if plan.pp > 1:  # the schedule runs the micro-batches (and pairs them under 1f1b)
                losses.append(par.pipeline_step(x, y).detach())
            else:
                _micro_batches(par, x.chunk(M), y.chunk(M), M, losses)
        for kind, n in par.ledger.take().items():
            if step > 0 and not (kind == "zero_param_gather" and plan.zero == 3):
                comm[kind] = comm.get(kind, 0) + n   # the overlap holds ZeRO-3's gathered
                                                     # weights: it gathers once per step
        norm = par.clip_grad_norm_(dc.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((sum(float(v) for v in losses), float(norm)))
        if step == 0 and par.baton is not None:  # counted from step 1: a pipeline's first step
            par.baton.take()                     # also runs torch's shape-inference forward
    if par.baton is not None:
        switches = par.baton.take()
    params = {n: _local(p).detach().clone() for n, p in par.model.named_parameters()}
    # the waits through the baton: its exchanges per MoE layer and micro-batch, times these
    waits = (STEPS - 1) * (plan.microbatches if plan.pp > 1 else M) * len(moe_layers(par.model))
    return out, params, switches, waits, comm


def _micro_batches(par, xs, ys, M, losses):
    """Forward and backward of M micro-batches, plain or interleaved, then the reduction."""
    def forward(i):
        loss = dc.task_loss(par.model(xs[i]), ys[i]) + collect_aux_loss(par.model)
        losses.append(loss.detach())
        return loss / M

    if par.baton is not None:
        par.set_grad_sync(False)
        run_interleaved(M, forward, lambda i, t: t.backward(), par.baton,
                        lambda: par.set_grad_sync(True))
    else:
        for i in range(M):
            par.set_grad_sync(i == M - 1)
            forward(i).backward()
    par.finish_backward()


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _worker(rank, world, layouts):
    rows = []
    for name, spec, moe_extra, exchanges, M in layouts:
        plain, p_params, _, _, p_comm = _train(world, spec, "none", moe_extra, M)
        inter, i_params, switches, waits, i_comm = _train(world, spec, "1f1b", moe_extra, M)
        rows.append((name, f"comm bytes by kind differ {p_comm} {i_comm}", float(p_comm != i_comm)))
        for step, (a, b) in enumerate(zip(plain, inter)):
            rows.append((name, f"step {step} loss, norm", abs(a[0] - b[0]) + abs(a[1] - b[1])))
        rows.append((name, "parameters", max(float((p_params[n] - i_params[n]).abs().max())
                                             for n in p_params)))
        rows.append((name, "waits through the baton", abs(switches["a2a_waits"] - waits * exchanges)))
        rows.append((name, "no hand-over", float(switches["a2a_handed"] == 0)))
    return rows


def _check(world, layouts, timeout):
    results = run_distributed(functools.partial(_worker, layouts=layouts), world, timeout=timeout)
    failures = [f"rank {r}: {name}: {metric} = {v:.3g}" for r, rows in enumerate(results)
                for name, metric, v in rows if v != 0]
    assert not failures, "\n".join(failures)
    assert all(len(rows) == len(layouts) * (STEPS + 4) for rows in results)


HIER = {"dispatch": "hierarchical"}
RANDOM = {"dropout": 0.1, "jitter": 0.01}
EVERY = {"every": 1}  # every block an MoE block (the pipeline layouts: each stage has exchanges)
# dispatch + combine + their backwards; hierarchical: two hops each way for the rows, one
# exchange of the gates (and its backward) and of the index (forward only, no autograd)
FLAT_X, HIER_X = 4, 10
W2 = [("dp2 ep2", {"dp": 2, "ep": 2}, {}, FLAT_X, 4),
      ("dp2 ep2 zero1", {"dp": 2, "ep": 2, "zero": 1}, {}, FLAT_X, 4),
      ("dp2 ep2 zero2", {"dp": 2, "ep": 2, "zero": 2}, {}, FLAT_X, 4),
      ("dp2 ep2 zero3", {"dp": 2, "ep": 2, "zero": 3}, {}, FLAT_X, 4),
      ("dp2 ep2 bf16 hierarchical on 2 nodes", {"dp": 2, "ep": 2, "precision": "bf16",
                                                "gpus_per_node": 1}, HIER, HIER_X, 4),
      ("dp2 ep2 recompute full", {"dp": 2, "ep": 2, "recompute": "full"}, {}, FLAT_X + 2, 4),
      ("dp2 ep2 recompute full dropout jitter", {"dp": 2, "ep": 2, "recompute": "full"},
       RANDOM, FLAT_X + 2, 4),
      ("dp2 ep2 recompute selective dropout jitter",
       {"dp": 2, "ep": 2, "recompute": "selective", "recompute_modules": "core_attn,moe_act"},
       RANDOM, FLAT_X, 4)]
W4 = [("tp2 dp2 ep2 zero1", {"tp": 2, "dp": 2, "ep": 2, "zero": 1}, {}, FLAT_X, 2),
      ("dp4 ep2 etp2", {"dp": 4, "ep": 2, "etp": 2}, {}, FLAT_X, 2)]
W8 = [("dp4 cp2 ep4 zero3 bf16 hierarchical on 2 nodes",
       {"dp": 4, "cp": 2, "ep": 4, "zero": 3, "precision": "bf16", "gpus_per_node": 4}, HIER, HIER_X, 2),
      ("pp2 tp2 dp2 ep4 dualpipev zero1 bf16 hierarchical on 2 nodes",
       {"pp": 2, "tp": 2, "dp": 2, "ep": 4, "microbatches": 4, "pp_schedule": "dualpipev",
        "zero": 1, "precision": "bf16", "gpus_per_node": 4}, {**HIER, **EVERY}, HIER_X, 0)]


def test_interleaved_micro_batches_equal_the_plain_loop_world2():
    _check(2, W2, timeout=400)


def test_interleaved_micro_batches_equal_the_plain_loop_world4():
    _check(4, W4, timeout=400)


def test_interleaved_micro_batches_equal_the_plain_loop_world8():
    _check(8, W8, timeout=500)


# ---- the in-layer overlap (moe.a2a_overlap_degree) under ZeRO-3 --------------------------
# FSDP2 would gather the experts once per chunk; parallel/data_parallel/fsdp.py holds them
# gathered across a layer's chunks and frees them after the last (forward and backward). The
# run equals one process (fp64, tests/tolerance.py rule 5: 1e-5 relative on loss and norm)
# and gathers exactly the bytes of the unchunked run.
Z3_RTOL = 1e-5


def _zero3_worker(rank, world):
    import copy
    model_cfg, moe_cfg = dc.configs()
    ref = dc.reference_run(model_cfg, copy.deepcopy(moe_cfg), dtype=torch.float64)
    rows, gathers = [], {}
    for d in (1, 2, 4):
        moe_cfg.a2a_overlap_degree = d
        comms = []
        got = dc.train_layout(world, {"dp": 4, "ep": 2, "zero": 3}, model_cfg, moe_cfg,
                              dtype=torch.float64, inspect=lambda *a: comms.append(a[-1]))
        gathers[d] = comms[-1]["zero_param_gather"]
        for step, ((l, g), (rl, rg)) in enumerate(zip(got, ref)):
            rows.append((f"d={d}", f"step {step}", max(abs(l - rl) / abs(rl), abs(g - rg) / abs(rg)) / Z3_RTOL))
    rows += [(f"d={d}", "gather bytes - d=1's", float(abs(gathers[d] - gathers[1]))) for d in (2, 4)]
    return rows


def test_chunked_overlap_under_zero3_equals_one_process_and_gathers_once():
    results = run_distributed(_zero3_worker, 4, timeout=400)
    failures = [f"rank {r}: {case} {metric} = {v:.3g}" for r, rows in enumerate(results)
                for case, metric, v in rows if v > (1 if "step" in metric else 0)]
    assert not failures, "\n".join(failures)
    assert all(len(rows) == 3 * dc.STEPS + 2 for rows in results)


# ---- inside the pipeline schedules (parallel/pipeline/paired_steps.py) -------------------------
# every block an MoE block, so each stage (one block under the two-stage-per-rank schedules)
# has exchanges to pair; 4 micro-batches, 1 row each per dp rank
PP = {"pp": 2, "dp": 2, "ep": 2, "microbatches": 4}
W4_PP = [(f"pp2 dp2 ep2 {s}", {**PP, "pp_schedule": s}, EVERY, FLAT_X, 0)
         for s in ("dualpipev", "zbv")] + [   # (the 1F1B family's pairs are refused: plan.py)
    ("pp2 dp2 ep2 zbv zero2", {**PP, "pp_schedule": "zbv", "zero": 2}, EVERY, FLAT_X, 0),
    ("pp2 dp2 ep2 dualpipev zero1 bf16", {**PP, "pp_schedule": "dualpipev", "zero": 1, "precision": "bf16"},
     EVERY, FLAT_X, 0)]


def test_interleaved_pipeline_schedules_equal_the_plain_schedules_world4():
    _check(4, W4_PP, timeout=600)
