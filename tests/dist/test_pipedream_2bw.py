"""PipeDream-2BW (parallel.pp_schedule=2bw) against a one-process reference of its rule.

2BW is not the synchronous function: step t applies the gradient of batch t-1, taken on the
weights before step t-1's update, W(t+1) = W(t) - lr * grad f(W(t-1)) (step 0 applies none).
The reference computes exactly that on one process (same micro-batches: the whole batch,
whose mean loss equals the micro-batches' mean) with AdamW and global-norm clipping. Per
step the loss (taken on the stashed version) and the grad norm, and after the last step
every weight, equal it within the dense matrix's fp32 tolerances (2e-5 abs + 1e-4 rel for
losses and norms, 1e-5 abs + 1e-4 rel for weights). The pipeline: pp=2 with 2 and 4
micro-batches, and pp=2 x dp=2; a drain in the middle (what evaluation and checkpoints do)
changes nothing. The live-tensor check: no stage ever holds more than 2 weight versions.
"""
import pytest

from moe.aux import collect_aux_loss
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
STEPS, ATOL, RTOL, W_ATOL = 7, 2e-5, 1e-4, 1e-5


def _configs():
    return dc.configs(tie=False)


def reference_2bw(steps=STEPS):
    """[(loss, grad_norm)] and final weights of the 2BW rule on one process."""
    import torch
    model_cfg, moe_cfg = _configs()
    model = dc.make_model(model_cfg, moe_cfg)
    opt = dc.adamw(model.parameters())
    pending, out = None, []
    for step in range(steps):
        x, y = dc.batch(step, model_cfg.vocab_size)
        loss = dc.task_loss(model(x), y) + collect_aux_loss(model)  # on the current weights
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        norm = torch.zeros(())
        if pending is not None:  # apply the previous batch's gradient
            for p, g in zip(model.parameters(), pending):
                p.grad = g
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), dc.CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        pending = grads
        out.append((loss.item(), norm.item()))
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, spec, drain_at):
    import torch
    from parallel.apply import parallelize
    from parallel.mesh import build_meshes
    from parallel.plan import ParallelPlan
    model_cfg, moe_cfg = _configs()
    plan = ParallelPlan(**spec).validate(world, model_cfg, moe_cfg, dc.B)
    meshes = build_meshes(plan)
    par = parallelize(dc.make_model(model_cfg, moe_cfg), plan, meshes, loss_fn=dc.task_loss)
    opt = par.prepare_optimizer(dc.adamw(par.model.parameters()))
    runner = par.pipeline
    dp_rank, n = meshes.rank("dp"), dc.B // plan.dp
    out, versions = [], 0
    for step in range(STEPS):
        x, y = dc.batch(step, model_cfg.vocab_size)
        x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
        loss = par.pipeline_step(x, y)
        versions = max(versions, _weight_versions(par.model, runner))
        norm = par.clip_grad_norm_(dc.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == drain_at:
            runner.drain()
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss, group=meshes.group("dp"))
        out.append((loss.item() / plan.dp, norm.item()))
    return out, {k: p.detach().clone() for k, p in par.model.named_parameters()}, versions


def _weight_versions(model, runner) -> int:
    """Distinct storages holding a version of the stage's first weight: the parameter's own
    and every stash's (the same storage counts once)."""
    name, p = next(iter(model.named_parameters()))
    held = {p.untyped_storage().data_ptr()}
    held |= {v[name].untyped_storage().data_ptr() for v in runner.stash.values()}
    return len(held)


@pytest.mark.parametrize("world,spec,drain_at", [
    (2, dict(pp=2, pp_schedule="2bw", microbatches=2), -1),
    (2, dict(pp=2, pp_schedule="2bw", microbatches=4), 3),
    (4, dict(dp=2, pp=2, pp_schedule="2bw", microbatches=2), 2),
])
def test_2bw_follows_the_delayed_update_rule(world, spec, drain_at):
    ref, ref_weights = reference_2bw()
    results = run_distributed(_worker, world, spec, drain_at, timeout=300)
    for rank, (losses, weights, versions) in enumerate(results):
        assert 1 <= versions <= 2, f"rank {rank}: {versions} weight versions held"
        for step, ((l, g), (rl, rg)) in enumerate(zip(losses, ref)):
            assert abs(l - rl) <= ATOL + RTOL * abs(rl), f"rank {rank} step {step}: loss {l} vs {rl}"
            assert abs(g - rg) <= ATOL + RTOL * abs(rg), f"rank {rank} step {step}: norm {g} vs {rg}"
        for name, w in weights.items():
            want = ref_weights[name]
            diff = (w - want).abs().max().item()
            assert diff <= W_ATOL + RTOL * want.abs().max().item(), f"rank {rank} {name}: {diff:.2e}"
