"""The parameter-server layout (parallel/param_server) against one process.

Shapes: B global batch (sequences), S tokens per sequence, W workers (= ranks), S_srv shards.

ps_staleness=0 (bulk-synchronous), 2 shards on 2 workers: 5 steps of the tiny MoE GPT of the
dense-layout tests, each worker on its half of the global batch, the shards applying AdamW
(expert tensors sharded per expert) or Adafactor (whole tensors); every step's loss (mean
over workers, from the servers) and gradient norm, and every final weight, equal one process
on the whole batch with the same optimizer and global-norm clipping. With 64 experts top-1
(most experts idle on a worker's 64 tokens) the push leaves untouched experts home and the
result is still the one-process one (the shards step them on a zero gradient).
Tolerance (fp32): losses and norms 2e-5 + 1e-4 relative (the layout matrix's); weights
1e-5 + 1e-4 x max |w| per tensor (the norm is summed over shards in another order, so the
clip factor differs in the last bits and AdamW carries it).

ps_staleness=2, 1 shard, worker 1 slowed by a stated sleep: training still lowers the loss,
and the staleness each worker saw at each pull (logged by the client) reaches 2 and never
exceeds it.
"""
import time

import pytest
import torch

from moe.aux import collect_aux_loss
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
ATOL, RTOL = 2e-5, 1e-4


def _optimizer(kind, model):
    if kind == "adafactor":
        from optim.adafactor import Adafactor
        return Adafactor(model.parameters(), lr=dc.LR, relative_step=False)
    return dc.adamw(model.parameters())


def _reference(kind, E, K, steps):
    model_cfg, moe_cfg = dc.configs(num_experts=E, top_k=K)
    model = dc.make_model(model_cfg, moe_cfg)
    opt = _optimizer(kind, model)
    out = []
    for step in range(steps):
        x, y = dc.batch(step, model_cfg.vocab_size)
        loss = dc.task_loss(model(x), y) + collect_aux_loss(model)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), dc.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), norm.item()))
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world, case, rpc_file):
    from parallel.data_parallel import param_server
    kind, E, K, servers, staleness, steps, slow = case
    model_cfg, moe_cfg = dc.configs(num_experts=E, top_k=K)
    model = dc.make_model(model_cfg, moe_cfg)
    opt = _optimizer(kind, model)
    client = param_server.start(model, opt, servers, staleness, rank, world,
                                init_method=f"file://{rpc_file}", per_expert=kind == "adamw")
    n = dc.B // world
    rows, seen, traffic = [], [], []
    for step in range(1, steps + 1):
        seen.append(client.pull(step))
        if slow and rank == 1:
            time.sleep(slow)
        x, y = dc.batch(step - 1, model_cfg.vocab_size)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        model.zero_grad(set_to_none=True)
        loss = dc.task_loss(model(x), y)
        aux = collect_aux_loss(model)
        (loss + aux).backward()
        mean_loss, mean_aux, norm, skipped, _ = client.push(step, dc.LR, loss, aux, dc.CLIP)
        rows.append((mean_loss + mean_aux, norm, skipped))
        traffic.append(client.take_traffic())
    torch.distributed.barrier()
    client.pull(steps + 1)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    param_server.stop(rank, servers)
    return rows, seen, traffic, weights


def _run(tmp_path, case, world=2):
    return run_distributed(_worker, world, case, str(tmp_path / f"rpc_{case[0]}_{case[1]}_{case[4]}"),
                           timeout=240)


def _close(a, b, atol, rtol) -> bool:
    return abs(a - b) <= atol + rtol * abs(b)


@pytest.mark.parametrize("kind, E, K", [("adamw", 4, 2), ("adafactor", 4, 2), ("adamw", 64, 1)],
                         ids=["adamw", "adafactor", "adamw-64-experts-sparse"])
def test_synchronous_ps_equals_one_process(tmp_path, kind, E, K):
    steps = dc.STEPS
    ref, ref_w = _reference(kind, E, K, steps)
    outs = _run(tmp_path, (kind, E, K, 2, 0, steps, 0.0))
    for rank, (rows, seen, traffic, weights) in enumerate(outs):
        assert seen == [0] * steps
        for step, ((loss, norm, skipped), (rl, rn)) in enumerate(zip(rows, ref)):
            assert not skipped
            assert _close(loss, rl, ATOL, RTOL), (rank, step, loss, rl)
            assert _close(norm, rn, ATOL, RTOL), (rank, step, norm, rn)
        assert set(weights) == set(ref_w)
        for name, w in weights.items():
            err = (w - ref_w[name]).abs().max().item()
            assert err <= 1e-5 + 1e-4 * ref_w[name].abs().max().item(), (rank, name, err)
        for t in traffic:
            assert t["pull"] == t["push_dense"] > 0
            assert t["push"] <= t["push_dense"] and t["push_expert"] <= t["push_expert_dense"]
    if E == 64:   # idle experts stayed home on some worker, some step
        saved = sum(t["push_expert_dense"] - t["push_expert"] for _, _, tr, _ in outs for t in tr)
        assert saved > 0, [tr for _, _, tr, _ in outs]


def test_bounded_staleness_is_enforced_and_training_progresses(tmp_path):
    steps, bound = 12, 2
    outs = _run(tmp_path, ("adamw", 4, 2, 1, bound, steps, 0.25))
    seen_all = [s for _, seen, _, _ in outs for s in seen]
    assert max(seen_all) == bound, seen_all           # the fast worker ran ahead up to the bound
    assert all(0 <= s <= bound for s in seen_all), seen_all
    fast = outs[0][0]
    first, last = sum(r[0] for r in fast[:3]) / 3, sum(r[0] for r in fast[-3:]) / 3
    assert last < first, [r[0] for r in fast]
    # both replicas end on the same (final) server weights
    for name, w in outs[0][3].items():
        assert torch.equal(w, outs[1][3][name]), name
