"""The divergence guard on one process: a non-finite loss skips the step with weights,
optimizer state and schedule untouched; a good step resets the count; train.max_skipped_steps
skips in a row raise Diverged naming the step; no checkpoint is written during a streak."""
import pytest
import torch

from data.prepare import prepare
from data.sampler import BatchSampler, open_split
from parallel.apply import parallelize
from parallel.plan import ParallelPlan
from trainer import checkpoint, telemetry
from trainer.config import load_config
from trainer.distributed import DistContext
from trainer.execution import Plain
from trainer.steps import Trainer
from trainer.metrics import MetricsLogger
from trainer.model import build_model, init_fn
from optim import WarmupCosine, build_optimizer
from trainer.stops import Diverged, StopRequest
from trainer.tasks import Task, token_loss

CTX = DistContext(0, 1, 0, torch.device("cpu"), "")
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "moe.num_experts=4", "data.seq_len=16", "train.batch_size=4", "train.eval_every=0",
        "log.moe_stats_every=0", "log.tensorboard=false", "log.progress=none",
        "train.max_skipped_steps=2", "checkpoint.every=1", "train.steps=10"]


def _trainer(tmp_path, text_dir):
    cfg = load_config(None, TINY + [f"run.dir={tmp_path / 'run'}"])
    data = prepare(str(text_dir), tmp_path / "data", val_fraction=0.25)
    files = (open_split(data, "train", 16), open_split(data, "val", 16))
    par = parallelize(build_model(cfg, CTX.device), ParallelPlan().validate(1), None,
                      loss_fn=token_loss, init_fn=init_fn(cfg, CTX.device))
    opt = build_optimizer(par.model, cfg.train)
    sched = WarmupCosine(opt, cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps, 0.1)
    sampler = BatchSampler(files[0].num_sequences, 4, 0, 0, 1)
    (tmp_path / "run").mkdir()
    log = MetricsLogger(tmp_path / "run", cfg.log, cfg.train.steps, 0, True)
    task = Task("gpt", 0, cfg.model.vocab_size, cfg.data, CTX.device)
    return Trainer(cfg, CTX, par, opt, sched, None, sampler, files, log, task, Plain(),
                   first_step=1, stop_request=StopRequest(),
                   step_flops=telemetry.step_flops(cfg, par.model))  # one process: the whole model


def _snapshot(tr):
    opt = {k: v.clone() for st in tr.optimizer.state.values() for k, v in st.items()
           if isinstance(v, torch.Tensor)}
    return ({k: v.clone() for k, v in tr.model.state_dict().items()}, opt, tr.sched.get_last_lr())


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0].values(), b[0].values())) and \
        all(torch.equal(x, y) for x, y in zip(a[1].values(), b[1].values())) and a[2] == b[2]


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch):
    text = tmp_path / "texts"
    text.mkdir()
    for i in range(8):
        (text / f"{i}.txt").write_text(f"document {i} " * 60)
    tr = _trainer(tmp_path, text)
    tr.step(1)
    real = tr.execution._forward_backward

    def nan_loss(trainer, batch, scale):  # real gradients, a NaN loss: only the guard stops the update
        loss, aux, stats = real(trainer, batch, scale)
        return loss * float("nan"), aux, stats
    before = _snapshot(tr)
    monkeypatch.setattr(tr.execution, "_forward_backward", nan_loss)
    tr.step(2)
    assert _same(before, _snapshot(tr)) and tr.in_a_row == 1
    assert [s for s, _ in checkpoint.list_complete(tr.cfg.run.dir)] == [1]  # none at step 2
    monkeypatch.setattr(tr.execution, "_forward_backward", real)
    tr.step(3)  # a good step updates and resets the count
    assert not _same(before, _snapshot(tr)) and tr.in_a_row == 0
    monkeypatch.setattr(tr.execution, "_forward_backward", nan_loss)
    tr.step(4)
    with pytest.raises(Diverged, match="2 consecutive steps, the last at step 5.*step_00000003"):
        tr.step(5)
    tr.log.close()
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert ['"skipped": true' in r for r in rows] == [False, True, False, True, True]
