"""Checkpoints (one process): round trip, atomicity under a crash mid-save, pruning,
and the run-directory rules (no silent overwrite, incompatible checkpoints refused)."""
import json

import pytest
import torch

import models
from trainer import checkpoint
from trainer.config import ConfigError, load_config, to_dict
from trainer.distributed import DistContext
from optim import build_optimizer
from trainer.run_dir import plan_start
from parallel.apply import parallelize
from parallel.plan import ParallelPlan

CTX = DistContext(0, 1, 0, torch.device("cpu"), "")
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "moe.num_experts=4", "train.steps=10"]


def _setup(tmp_path, extra=()):
    cfg = load_config(None, TINY + [f"run.dir={tmp_path / 'run'}", *extra])
    model = models.init_weights(models.build_model(cfg.model, cfg.moe), seed=0, device="cpu")
    return cfg, parallelize(model, ParallelPlan().validate(1)), build_optimizer(model, cfg.train)


def _train_steps(model, opt, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 256, (2, 9), generator=g)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _state(step, cfg):
    return {"scheduler": {"last_step": step}, "sampler": {"position": step * 4}, "config": to_dict(cfg)}


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    cfg, par, opt = _setup(tmp_path)
    model = par.model
    _train_steps(model, opt, 2)
    torch.manual_seed(123)
    path = checkpoint.save(CTX, cfg.run.dir, 2, par, opt, _state(2, cfg), keep=2)
    after_save = torch.rand(3)
    want = _params(model)
    _train_steps(model, opt, 2, seed=1)
    ref_next = _params(model)

    cfg2, par2, opt2 = _setup(tmp_path)
    model2 = par2.model
    info = checkpoint.load(CTX, path, par2, opt2)
    assert info["step"] == 2 and info["sampler"]["position"] == 8
    assert torch.equal(torch.rand(3), after_save)  # RNG restored
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k
    _train_steps(model2, opt2, 2, seed=1)  # optimizer state restored: identical next steps
    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref_next[k]), k


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    cfg, par, opt = _setup(tmp_path)
    model = par.model
    checkpoint.save(CTX, cfg.run.dir, 1, par, opt, _state(1, cfg), keep=1)
    good = _params(model)
    _train_steps(model, opt, 1)

    def crash(*a, **k):
        raise RuntimeError("simulated crash while writing")
    monkeypatch.setattr(checkpoint, "_rng_state", crash)  # dies after the DCP files are written
    with pytest.raises(RuntimeError, match="simulated"):
        checkpoint.save(CTX, cfg.run.dir, 2, par, opt, _state(2, cfg), keep=1)
    monkeypatch.undo()
    root = checkpoint.checkpoint_root(cfg.run.dir)
    assert (root / ".tmp-step_00000002").is_dir()  # the half-written one is there ...
    assert [s for s, _ in checkpoint.list_complete(cfg.run.dir)] == [1]  # ... but never taken
    _, par2, opt2 = _setup(tmp_path)
    model2 = par2.model
    checkpoint.load(CTX, checkpoint.latest(cfg.run.dir), par2, opt2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, good[k]), k
    # a directory without COMPLETE (e.g. copied half-way) is ignored as well
    (root / "step_00000009").mkdir()
    (root / "step_00000009" / "trainer.json").write_text("{}")
    assert checkpoint.latest(cfg.run.dir).name == "step_00000001"
    # the next successful save removes the stale temp dir and prunes to `keep`
    checkpoint.save(CTX, cfg.run.dir, 3, par, opt, _state(3, cfg), keep=1)
    assert [s for s, _ in checkpoint.list_complete(cfg.run.dir)] == [3]
    assert not (root / ".tmp-step_00000002").exists()  # stale temp dirs are cleaned up


def test_run_dir_rules(tmp_path):
    cfg, par, opt = _setup(tmp_path)
    model = par.model
    assert plan_start(cfg, 1) is None  # empty dir: fresh start
    checkpoint.save(CTX, cfg.run.dir, 4, par, opt, _state(4, cfg), keep=2)
    with pytest.raises(ConfigError, match="train.resume=true.*run.overwrite=true"):
        plan_start(cfg, 1)
    resumed = load_config(None, TINY + [f"run.dir={cfg.run.dir}", "train.resume=true",
                                        "model.dropout=0.1", "moe.capacity_factor=2.0"])
    assert plan_start(resumed, 1).name == "step_00000004"  # behaviour-only changes are fine
    bad = load_config(None, TINY + [f"run.dir={cfg.run.dir}", "train.resume=true", "model.d_model=64"])
    with pytest.raises(ConfigError, match="model.d_model: 32 -> 64"):
        plan_start(bad, 1)
    short = load_config(None, TINY + [f"run.dir={cfg.run.dir}", "train.resume=true", "train.steps=3"])
    with pytest.raises(ConfigError, match="train.steps"):
        plan_start(short, 1)
    saved = json.loads((checkpoint.latest(cfg.run.dir) / "trainer.json").read_text())
    assert saved["config"]["model"]["d_model"] == 32  # nothing was overwritten by the refusals


def _shard(ckpt):
    return sorted(ckpt.glob("*.distcp"))[0]


CORRUPTIONS = {  # what happens to the newest checkpoint -> the file the error must name
    "truncated shard": (lambda c: _shard(c).write_bytes(_shard(c).read_bytes()[:100]), "__0_0.distcp"),
    "garbage .metadata": (lambda c: (c / ".metadata").write_bytes(b"garbage"), ".metadata"),
    "empty trainer.json": (lambda c: (c / "trainer.json").write_text(""), "trainer.json"),
    "deleted shard": (lambda c: _shard(c).unlink(), "__0_0.distcp is missing"),
    "same-size garbage in a shard": (
        lambda c: _shard(c).write_bytes(bytes(_shard(c).stat().st_size)), "__0_0.distcp does not match"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_resume_names_the_bad_file_and_falls_back(tmp_path, capsys, kind):
    cfg, par, opt = _setup(tmp_path)
    checkpoint.save(CTX, cfg.run.dir, 1, par, opt, _state(1, cfg), keep=2)
    good = _params(par.model)
    _train_steps(par.model, opt, 1)
    newest = checkpoint.save(CTX, cfg.run.dir, 2, par, opt, _state(2, cfg), keep=2)
    assert checkpoint.verify(newest) == ""
    corrupt, named = CORRUPTIONS[kind]
    corrupt(newest)
    assert named in checkpoint.verify(newest)

    resumed = load_config(None, TINY + [f"run.dir={cfg.run.dir}", "train.resume=true"])
    found = plan_start(resumed, 1)
    assert found.name == "step_00000001"
    err = capsys.readouterr().err
    assert f"checkpoint step_00000002 rejected: {newest}" in err and named in err, err
    assert not newest.exists()  # moved aside, so step 2 is saved afresh when training gets there
    assert (checkpoint.checkpoint_root(cfg.run.dir) / "rejected" / "step_00000002").is_dir()
    _, par2, opt2 = _setup(tmp_path)
    checkpoint.load(CTX, found, par2, opt2)
    for k, v in par2.model.state_dict().items():
        assert torch.equal(v, good[k]), k
    again = checkpoint.save(CTX, cfg.run.dir, 2, par2, opt2, _state(2, cfg), keep=2)
    assert checkpoint.verify(again) == ""


def test_manifest_lists_every_file_and_a_dir_without_complete_is_moved_aside(tmp_path):
    cfg, par, opt = _setup(tmp_path)
    root = checkpoint.checkpoint_root(cfg.run.dir)
    (root / "step_00000003").mkdir(parents=True)  # e.g. a copy that stopped half-way
    (root / "step_00000003" / "__0_0.distcp").write_bytes(b"partial")
    path = checkpoint.save(CTX, cfg.run.dir, 3, par, opt, _state(3, cfg), keep=2)  # no OSError
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in path.iterdir()
                                   if p.name not in ("manifest.json", "COMPLETE"))
    assert {"trainer.json", "rng_rank0.pt", ".metadata"} <= set(files)
    assert (root / "rejected" / "step_00000003" / "__0_0.distcp").read_bytes() == b"partial"
    assert checkpoint.verify(path) == ""


def test_all_checkpoints_bad_is_an_error_not_a_silent_restart(tmp_path):
    cfg, par, opt = _setup(tmp_path)
    path = checkpoint.save(CTX, cfg.run.dir, 1, par, opt, _state(1, cfg), keep=2)
    (path / "trainer.json").write_text("")
    resumed = load_config(None, TINY + [f"run.dir={cfg.run.dir}", "train.resume=true"])
    with pytest.raises(ConfigError, match="no checkpoint in .* verifies"):
        plan_start(resumed, 1)


def test_weights_from_a_missing_path_say_it_does_not_exist(tmp_path):
    from trainer.checkpoint import load_model_weights
    with pytest.raises(ValueError, match=r"nope does not exist; pass a run dir"):
        load_model_weights(tmp_path / "nope", par=None)
