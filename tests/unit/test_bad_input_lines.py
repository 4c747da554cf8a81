"""Bad input a new user gives, each answered with one line that names the field and the right
fix (issue 46's list): the planner's numbers, its --layout against --world, the world-size
hint under context parallelism, run.device=cuda without CUDA, and a does-not-fit peak that
rounding would hide."""
import pytest
import torch

from commands.plan import main as plan_main
from parallel.planner.predict import _gb
from trainer.config import ConfigError, load_config, validate


@pytest.mark.parametrize("argv, line", [
    (["--world", "8", "--top", "0"], "error: --top 0 must be > 0"),
    (["--world", "8", "--flops", "0"], "error: --flops 0 must be > 0"),
    (["--world", "8", "--gpus-per-node", "0"], "error: --gpus-per-node 0 must be > 0"),
    (["--world", "0"], "error: --world 0 must be > 0"),
    (["--world", "8", "--gpu-mem", "-1"], "error: --gpu-mem -1 must be > 0"),
    (["--world", "8", "--imbalance", "0.5"], "error: --imbalance 0.5 must be >= 1"),
    (["--world", "8", "--nodes-per-token", "-1"], "error: --nodes-per-token -1 must be >= 0"),
    (["--world", "8", "--layout", "dp3 pp4"],
     "error: --layout 'dp3 pp4' does not use the 8 GPUs of --world: parallel.dp*tp*pp = 3*1*4 = 12 "
     "but the world size is 8; pass --world with that many GPUs, or change the layout's words"),
])
def test_planner_arguments(argv, line, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and len(err.splitlines()) == 1, err


def test_context_parallel_world_hint_names_cp():
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["parallel.cp=2"]), 1)
    assert "choose tp, pp, cp whose product divides 1 (parallel.tp=1 parallel.pp=1 parallel.cp=1)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, ["parallel.cp=3", "data.seq_len=96"]), 4)
    assert "parallel.cp=" in str(e.value) and "parallel.cp=3)" not in str(e.value), str(e.value)


def test_cuda_without_cuda_is_a_config_error(monkeypatch):
    from trainer.distributed import choose_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"run.device='cuda' but CUDA is not available; use "
                                          r"run.device='auto' or 'cpu'"):
        choose_device("cuda", 0)


def test_a_peak_just_over_the_memory_shows_why():
    assert _gb(80_000_001_000, 80_000_000_000) == "80.000001"   # 80.00 would read as equal
    assert _gb(95_240_000_000, 80_000_000_000) == "95.24"


def test_hf_config_that_is_not_an_object_or_lacks_a_key(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "short.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=r"holds a JSON list, not the object of a transformers config.json"):
        load_config(None, [f"hf.config={tmp_path / 'list.json'}"])
    with pytest.raises(ConfigError, match=r"has no 'num_attention_heads', which its model_type's "
                                          r"config.json always holds"):
        load_config(None, [f"hf.config={tmp_path / 'short.json'}"])
