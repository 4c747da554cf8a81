"""train.py with parallel.recompute=selective: the same losses as without recomputation, to
the last digit (one process, dp2 x ep2, and tp2 under bf16), the layout line naming the parts; a part the
model lacks is refused in one line before anything runs."""
import pytest

from tests.e2e.test_train import TINY, losses, train

pytestmark = pytest.mark.e2e
PARTS = "parallel.recompute_modules=core_attn,layernorm,moe_act,experts,mlp"


@pytest.mark.parametrize("nproc, layout", [
    (1, []), (2, ["parallel.dp=2", "parallel.ep=2"]),
    # layernorm under tp (sequence parallel), bf16: the gathered bf16 copy rebuilt in backward
    (2, ["parallel.dp=1", "parallel.tp=2", "parallel.precision=bf16"])])
def test_selective_same_losses_as_none(tmp_path, nproc, layout):
    common = TINY + layout + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4",
                              "checkpoint.every=0", "checkpoint.at_end=false",
                              "log.tensorboard=false"]
    plain, sel = tmp_path / "plain", tmp_path / "sel"
    train(common + [f"run.dir={plain}"], tmp_path, nproc=nproc)
    out = train(common + [f"run.dir={sel}", "parallel.recompute=selective", PARTS], tmp_path, nproc=nproc)
    assert "recompute=selective recompute_modules=core_attn,layernorm,moe_act,experts,mlp" in out.stdout + out.stderr
    assert losses(sel) == losses(plain) and sorted(losses(sel)) == [1, 2, 3, 4]


def test_a_part_the_model_lacks_is_refused(tmp_path):
    out = train(TINY + ["parallel.recompute=selective", "parallel.recompute_modules=mla_up_proj",
                        f"run.dir={tmp_path / 'r'}"], tmp_path, check=False)
    assert out.returncode != 0
    assert "parallel.recompute_modules=mla_up_proj: the model has no mla_up_proj (needs " \
           "model.attention='mla'); drop it from parallel.recompute_modules" in out.stdout + out.stderr
