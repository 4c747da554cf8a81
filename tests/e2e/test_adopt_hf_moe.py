"""train.py adopts Hugging Face MoE checkpoints (hf.family=qwen3_moe / deepseek_v3 with
hf.pretrained): the same losses under dp=2 ep=2 as one process (1e-4 relative: reduction
order only), routing printed at start, [moe] overrides refused, checkpoints and the profiler
work on the adopted model."""
import pytest
import torch
import transformers

from tests.e2e.test_train import close, losses, train
from tests.unit import hf_moe_models

pytestmark = pytest.mark.e2e
COMMON = ["data.seq_len=32", "train.batch_size=8", "data.max_bytes=1000000", "train.steps=4",
          "train.eval_every=0", "train.warmup_steps=2", "log.progress=plain", "log.every=1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def _checkpoint(family, path):
    cfg = hf_moe_models.config(family)
    cfg.vocab_size = 256  # the byte tokenizer's ids
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_adopted_model_trains_alike_under_dp2_ep2(family, tmp_path, cache):
    ckpt = _checkpoint(family, tmp_path / "hf")
    args = COMMON + [f"data.cache_dir={cache}", f"hf.family={family}", f"hf.pretrained={ckpt}"]
    one = train(args + [f"run.dir={tmp_path / 'one'}"], tmp_path)
    assert "routing (hf.model.layers." in one.stdout
    train(args + [f"run.dir={tmp_path / 'two'}", "parallel.dp=2", "parallel.ep=2"], tmp_path, nproc=2)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert close(a[step], b[step], 1e-4), (family, step, a[step], b[step])
    assert (tmp_path / "two" / "checkpoints" / "step_00000004" / "COMPLETE").is_file()


def test_moe_overrides_refused_and_profile_runs(tmp_path, cache):
    ckpt = _checkpoint("qwen3_moe", tmp_path / "hf")
    args = COMMON + [f"data.cache_dir={cache}", "hf.family=qwen3_moe", f"hf.pretrained={ckpt}"]
    bad = train(args + ["moe.top_k=1", f"run.dir={tmp_path / 'bad'}"], tmp_path, check=False)
    assert bad.returncode == 2 and "moe.top_k set" in bad.stderr
    train(args + ["train.steps=2", f"run.dir={tmp_path / 'run'}"], tmp_path)
    cfg_file = tmp_path / "adopt.toml"
    cfg_file.write_text(f'[hf]\nfamily = "qwen3_moe"\npretrained = "{ckpt}"\n[data]\nseq_len = 32\n'
                        f'max_bytes = 1000000\ncache_dir = "{cache}"\n[train]\nbatch_size = 8\n')
    from commands.profile import main
    assert main(["--config", str(cfg_file), "--checkpoint", str(tmp_path / "run"),
                 "--out", str(tmp_path / "prof"), "--batches", "1"]) == 0
    assert (tmp_path / "prof" / "load.json").is_file()
