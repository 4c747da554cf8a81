"""Config system: defaults, TOML, overrides, type checks, helpful errors, round trip, help."""
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import (ConfigError, Config, help_text, load_config, section_names, to_toml,
                            validate)

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_validate_and_required_names_exist():
    cfg = load_config()
    plan = validate(cfg, 1)
    assert plan.dp == 1
    for dotted in ("run.dir", "train.steps", "train.seed", "train.batch_size", "model.dropout",
                   "parallel.dp", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.zero",
                   "moe.num_experts", "moe.top_k", "moe.capacity_factor"):
        section, name = dotted.split(".")
        assert hasattr(getattr(cfg, section), name), dotted


def test_toml_then_overrides_later_wins(tmp_path):
    p = _write(tmp_path, '[train]\nsteps = 7\nlr = 0.5\n[moe]\ntop_k = 1\n[run]\ndir = "x"\n')
    cfg = load_config(p, ["train.steps=9", "moe.capacity_factor=1.25", "run.dir=y/z",
                          "model.dropout=0.1", "parallel.zero=1", "train.resume=true"])
    assert (cfg.train.steps, cfg.train.lr, cfg.moe.top_k) == (9, 0.5, 1)
    assert cfg.moe.capacity_factor == 1.25 and cfg.run.dir == "y/z"
    assert cfg.model.dropout == 0.1 and cfg.parallel.zero == 1 and cfg.train.resume is True
    assert isinstance(cfg.train.lr, float)
    # ints given for floats are accepted as floats
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0


def test_dropless_spellings():
    for raw in ("none", "0", '"none"'):
        cfg = load_config(None, [f"moe.capacity_factor={raw}"])
        validate(cfg, 1)
        assert cfg.moe.capacity_factor is None, raw


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["train.steps=11", "moe.capacity_factor=2.0", "run.dir=a b"])
    again = load_config(_write(tmp_path, to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("override, words", [
    ("train.stpes=3", ["train.steps"]),
    ("trian.steps=3", ["'train'"]),
    ("moe.num_expert=4", ["moe.num_experts"]),
    ("train.steps=1.5", ["train.steps", "int"]),
    ("train.steps=abc", ["train.steps", "int"]),
    ("train.resume=1", ["train.resume", "bool"]),
    ("moe.capacity_factor=abc", ["moe.capacity_factor"]),
    ("log.progress=fancy", ["log.progress", "bar"]),
    ("steps=3", ["section.field=value"]),
])
def test_bad_overrides_name_the_field(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value), (override, str(e.value))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[train\nsteps = 3"))
    with pytest.raises(ConfigError, match="train.steps.*int"):
        load_config(_write(tmp_path, '[train]\nsteps = "many"'))
    with pytest.raises(ConfigError, match="section"):
        load_config(_write(tmp_path, "steps = 3"))
    with pytest.raises(ConfigError, match="did you mean 'train.batch_size'"):
        load_config(_write(tmp_path, "[train]\nbatchsize = 3"))


@pytest.mark.parametrize("overrides, world, words", [
    (["parallel.dp=3"], 2, ["parallel.dp"]),
    (["parallel.ep=3"], 2, ["parallel.ep"]),
    (["moe.top_k=9"], 1, ["moe.top_k"]),
    (["model.n_heads=3"], 1, ["model.n_heads"]),
    (["train.batch_size=3"], 2, ["train.batch_size"]),
    (["train.micro_batch_size=3"], 1, ["train.micro_batch_size"]),
    (["data.seq_len=999"], 1, ["data.seq_len", "model.max_seq_len"]),
    (["train.steps=0"], 1, ["train.steps"]),
    (["moe.experts_impl=fast"], 1, ["moe.experts_impl", "grouped_mm"]),
    (["moe.force_balance=true", "moe.router=expert_choice"], 1, ["moe.force_balance"]),
    (["moe.replica_slots=1"], 1, ["moe.replica_slots=1", "parallel.ep > 1", "moe.replica_slots=0"]),
    (["moe.replica_slots=-1"], 1, ["moe.replica_slots", ">= 0"]),
    (["moe.replica_slots=7", "parallel.ep=2"], 2, ["moe.replica_slots=7", "at most 4"]),
    (["moe.a2a_overlap_degree=2"], 1, ["moe.a2a_overlap_degree=2", "parallel.ep > 1"]),
    (["moe.a2a_overlap_degree=0"], 1, ["moe.a2a_overlap_degree", ">= 1"]),
    (["parallel.a2a_overlap=1f1b", "parallel.ep=2"], 2,
     ["parallel.a2a_overlap=1f1b", "train.micro_batch_size=0 gives 1 micro-batch"]),
    (["parallel.a2a_overlap=1f1b"], 2, ["parallel.a2a_overlap=1f1b", "parallel.ep > 1"]),
    (["moe.dispatch=hierarchical"], 1, ["moe.dispatch=hierarchical", "parallel.ep > 1"]),
    (["moe.max_nodes=1", "parallel.ep=2", "moe.replica_slots=1"], 2, ["moe.max_nodes=1", "moe.replica_slots=1"]),
    (["parallel.gpus_per_node=3"], 2, ["parallel.gpus_per_node=3", "divisor of the world size"]),
    (["moe.dispatch_dtype=fp16"], 1, ["moe.dispatch_dtype", "fp8"]),
    (["moe.dispatch_dtype=fp8", "parallel.precision=fp16"], 1, ["moe.dispatch_dtype=fp8", "precision=bf16"]),
    (["parallel.ps_servers=3"], 2, ["parallel.ps_servers=3", "at most 2"]),
    (["parallel.ps_servers=2", "parallel.zero=1"], 2, ["parallel.ps_servers=2", "parallel.zero=0"]),
    (["parallel.ps_servers=2", "parallel.ep=2"], 2, ["parallel.ps_servers=2", "parallel.ep=1"]),
    (["parallel.ps_staleness=1"], 2, ["parallel.ps_staleness=1", "ps_servers >= 1"]),
    (["parallel.ps_servers=1", "parallel.precision=fp16"], 2, ["parallel.ps_servers=1", "fp16"]),
    (["parallel.zero_prefetch=2"], 2, ["parallel.zero_prefetch=2", "parallel.zero=3"]),
    (["parallel.zero_prefetch=-1", "parallel.zero=3"], 2, ["parallel.zero_prefetch", ">= 0"]),
    (["parallel.pp=2", "train.micro_batch_size=4", "parallel.microbatches=2",
      "model.tie_embeddings=false"], 2,
     ["train.micro_batch_size", "parallel.microbatches"]),
    (["moe.router_replay=r.pt", "parallel.pp=2"], 2, ["moe.router_replay", "parallel.pp=1"]),
    (["moe.router_replay=r.pt", "parallel.tp=2"], 2, ["moe.router_replay", "parallel.tp=1"]),
    (["moe.router_replay=r.pt", "parallel.cp=2"], 2, ["moe.router_replay", "parallel.cp=1"]),
    (["moe.router_replay=r.pt", "parallel.ps_servers=1"], 2,
     ["moe.router_replay", "parallel.ps_servers=0"]),
    (["moe.router_replay=r.pt", "model.arch=switch"], 1, ["moe.router_replay", "encoder-decoder"]),
    (["moe.router_replay=r.pt", "moe.router=expert_choice"], 1,
     ["moe.router_replay", "moe.router='token_choice'"]),
    (["moe.router_replay=r.pt", "moe.every=0"], 1, ["moe.router_replay", "dense model"]),
    (["train.optimizer=muon", "parallel.ps_servers=1"], 2, ["train.optimizer='muon'", "parallel.ps_servers=0"]),
    (["parallel.param_dtype=bf16", "parallel.precision=bf16"], 1, ["parallel.param_dtype=bf16", "parallel.zero=1, 2 or 3"]),
    (["parallel.param_dtype=bf16", "parallel.zero=1"], 1, ["parallel.param_dtype=bf16", "precision=bf16"]),
    (["parallel.param_dtype=fp16"], 1, ["parallel.param_dtype='fp16'", "fp32, bf16"]),
    (["train.optimizer=muon", "parallel.pp=2", "parallel.pp_schedule=2bw", "parallel.microbatches=2",
      "model.tie_embeddings=false"], 2,
     ["train.optimizer='muon'", "2bw"]),
    (["train.step_checks=device", "parallel.precision=fp16"], 1,
     ["train.step_checks='device'", "parallel.precision='fp16'", "train.step_checks='host'"]),
    (["train.step_checks=device", "train.optimizer=adafactor"], 1,
     ["train.step_checks='device'", "set train.optimizer='adamw'"]),
    (["train.step_checks=device", "train.optimizer_impl=foreach"], 1,
     ["train.step_checks='device'", "optimizer_impl='foreach'", "'fused'"]),
    (["train.step_checks=device", "parallel.pp=2", "model.tie_embeddings=false"], 2,
     ["train.step_checks='device'", "parallel.pp=2", "pp=1"]),
    (["train.step_checks=device", "parallel.ps_servers=1"], 2, ["train.step_checks='device'", "ps_servers=1"]),
    (["train.step_checks=device", "parallel.zero=1", "parallel.offload=optimizer"], 2,
     ["train.step_checks='device'", "parallel.offload='optimizer'"]),
])
def test_impossible_layouts_and_values(overrides, world, words):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world)
    for w in words:
        assert w in str(e.value), (overrides, str(e.value))


def test_help_lists_every_section_and_field():
    text = help_text()
    cfg = Config()
    for section in section_names():
        assert f"[{section}]" in text
        for name in vars(getattr(cfg, section)):
            assert f"{section}.{name} (" in text
    assert "GLOBAL batch" in text  # docstrings are shown


def test_cli_errors_are_short_and_nothing_runs(tmp_path):
    """train.py prints one error line (no traceback), exits 2, creates no run dir."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "train.py", f"run.dir={run_dir}", "train.stepz=3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "did you mean 'train.steps'" in out.stderr and "Traceback" not in out.stderr
    assert not run_dir.exists()
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "train.batch_size" in out.stdout
