"""The divergence guard on one process: a non-finite loss skips the step with weights,
optimizer state and schedule untouched; a good step resets the count; train.max_skipped_steps
skips in a row raise Diverged naming the step; no checkpoint is written during a streak."""
import json

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
from trainer.step_checks import DeviceChecks
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


def _trainer(tmp_path, text_dir, extra=()):
    cfg = load_config(None, TINY + list(extra) + [f"run.dir={tmp_path / 'run'}"])
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
    checks = DeviceChecks(CTX, CTX.device) if cfg.train.step_checks == "device" else None
    return Trainer(cfg, CTX, par, opt, sched, None, sampler, files, log, task, Plain(),
                   first_step=1, stop_request=StopRequest(),
                   step_flops=telemetry.step_flops(cfg, par.model),  # one process: the whole model
                   checks=checks)


def _snapshot(tr):
    opt = {k: v.clone() for st in tr.optimizer.state.values() for k, v in st.items()
           if isinstance(v, torch.Tensor)}
    return ({k: v.clone() for k, v in tr.model.state_dict().items()}, opt, tr.sched.get_last_lr())


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0].values(), b[0].values())) and \
        all(torch.equal(x, y) for x, y in zip(a[1].values(), b[1].values())) and a[2] == b[2]


def _texts(tmp_path):
    text = tmp_path / "texts"
    text.mkdir()
    for i in range(8):
        (text / f"{i}.txt").write_text(f"document {i} " * 60)
    return text


# checkpoint.every=1: train.step_checks=device reads the device every step, as host does
@pytest.mark.parametrize("checks", ["host", "device"])
def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch, checks):
    tr = _trainer(tmp_path, _texts(tmp_path), [f"train.step_checks={checks}"])
    tr.step(1)
    real = tr.execution._forward_backward

    def nan_loss(trainer, batch, scale):  # real gradients, a NaN loss: only the guard stops the update
        loss, aux, stats, mtp = real(trainer, batch, scale)
        return loss * float("nan"), aux, stats, mtp
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


DEFERRED = ["log.every=5", "checkpoint.every=0", "checkpoint.at_end=false", "train.steps=6",
            "moe.bias_update_rate=0.01", "train.optimizer_impl=fused"]


@pytest.mark.parametrize("mtp", [[], ["model.mtp_depth=1"]], ids=["plain", "mtp"])
def test_device_checks_defer_the_read_and_equal_the_host_bit_for_bit(tmp_path, monkeypatch, mtp):
    """Steps 2 and 3 non-finite, read at step 5: the device mode skips them on the device
    (weights, AdamW moments and step counts, router bias and its pending load as they were,
    the steps after them at the host mode's learning rate) and its records, read in one go
    (with a multi-token prediction depth: its losses in the same copy), equal the host
    mode's; every final tensor is equal bit for bit."""
    runs = {}
    for checks in ("host", "device"):
        tr = _trainer(tmp_path / checks, _texts_in(tmp_path / checks),
                      DEFERRED + mtp + ["train.max_skipped_steps=0", f"train.step_checks={checks}"])
        # the sampler's position is the step count: a skipped step still consumes its batch
        calls = {"n": 0}
        real = tr.execution._forward_backward

        def nan_2_3(trainer, batch, scale, real=real, calls=calls):
            calls["n"] += 1
            loss, aux, stats, mtp = real(trainer, batch, scale)
            return (loss * float("nan") if calls["n"] in (2, 3) else loss), aux, stats, mtp
        monkeypatch.setattr(tr.execution, "_forward_backward", nan_2_3)
        for n in range(1, 5):
            tr.step(n)
        if checks == "device":  # nothing read yet: no record, no count; the device skipped
            assert len(tr.checks.held) == 4 and tr.in_a_row == 0 and int(tr.checks.skips) == 2
            assert not (tmp_path / checks / "run" / "metrics.jsonl").read_text()
        for n in (5, 6):
            tr.step(n)
        tr.log.close()
        rows = (tmp_path / checks / "run" / "metrics.jsonl").read_text().splitlines()
        keys = ("step", "loss", "aux_loss", "lr", "grad_norm", "skipped") + (("mtp_loss_1",) if mtp else ())
        runs[checks] = ([{k: r[k] for k in keys} for r in map(json.loads, rows)], _snapshot(tr), tr.sched.last_step,
                        {k: v.clone() for k, v in tr.model.named_buffers()})
    host, device = runs["host"], runs["device"]
    assert [r["skipped"] for r in host[0]] == [False, True, True, False, False, False]
    assert host[0] == device[0]  # losses, norms and learning rates, exactly
    assert _same(host[1], device[1]) and host[2] == device[2] == 4  # 4 steps taken
    assert host[3].keys() == device[3].keys() and any("selection_bias" in k for k in host[3])
    assert all(torch.equal(host[3][k], device[3][k]) for k in host[3])


def test_device_checks_stop_a_divergence_at_the_read_naming_its_step(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, _texts(tmp_path), DEFERRED + ["train.step_checks=device"])
    calls = {"n": 0}
    real = tr.execution._forward_backward

    def nan_2_3(trainer, batch, scale):
        calls["n"] += 1
        loss, aux, stats, mtp = real(trainer, batch, scale)
        return (loss * float("nan") if calls["n"] in (2, 3) else loss), aux, stats, mtp
    monkeypatch.setattr(tr.execution, "_forward_backward", nan_2_3)
    for n in range(1, 5):
        tr.step(n)  # the streak is on the device: no stop yet
    with pytest.raises(Diverged, match="2 consecutive steps, the last at step 3"):
        tr.step(5)


def _texts_in(path):
    path.mkdir(parents=True)
    return _texts(path)


@pytest.mark.parametrize("overrides, device, fused, want", [
    ([], "cpu", False, "host"),                     # auto: a CPU run keeps the host's check
    ([], "cuda", True, "device"),                   # auto on CUDA with the fused AdamW
    (["parallel.precision=fp16"], "cuda", True, "host"),  # the loss scaler reads on the host
    ([], "cuda", False, "host"),                    # an unfused AdamW has no found_inf
    (["train.step_checks=host"], "cuda", True, "host"),
    (["train.step_checks=device"], "cpu", True, "device"),
])
def test_step_checks_resolved(overrides, device, fused, want):
    from parallel.plan import ParallelPlan
    from trainer.step_checks import resolve_step_checks
    cfg = load_config(None, overrides)
    plan = ParallelPlan(precision=cfg.parallel.precision).validate(1)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=fused)
    assert resolve_step_checks(cfg, plan, opt, torch.device(device)) == want
