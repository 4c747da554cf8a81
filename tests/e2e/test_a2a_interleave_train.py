"""train.py under torchrun with parallel.a2a_overlap=1f1b (dp2 x ep2, 2 micro-batches per
rank, train.micro_batch_size=2): the same losses as the plain micro-batch loop, bit for bit
(each micro-batch runs the same operations in the same order, parallel/interleave.py), and
metrics.jsonl reports the exchanges waited for through the baton; a layout without
micro-batches is refused in one line. The same inside a pipeline schedule (pp2 x dp2 x ep2,
DualPipe-V, 4 micro-batches: the schedule's forward/backward pairs, parallel/pipeline/
paired_steps.py); the 1F1B family is refused in one line (its pairs delay the next stage).
"""
import pytest

from tests.e2e.test_train import TINY, losses, records, train

pytestmark = pytest.mark.e2e


def test_1f1b_same_losses_as_the_plain_loop(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=5", "parallel.dp=2",
                     "parallel.ep=2", "train.micro_batch_size=2", "checkpoint.every=0",
                     "checkpoint.at_end=false", "log.tensorboard=false", "log.progress=none"]
    plain, inter = tmp_path / "plain", tmp_path / "inter"
    train(common + [f"run.dir={plain}"], tmp_path, nproc=2)
    train(common + [f"run.dir={inter}", "parallel.a2a_overlap=1f1b"], tmp_path, nproc=2)
    ref, got = losses(plain), losses(inter)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    assert got == ref
    for rec in records(inter):
        # 2 micro-batches x 1 MoE layer (TINY: 2 blocks, every 2nd) x 4 exchanges; F1 hands
        # over at each of its 2 and B0 at each of its 2
        assert rec["a2a_waits"] == 8 and rec["a2a_handed"] == 4, rec
        assert rec["a2a_exposed_s"] > 0  # gloo: the host blocked in each of the 8 waits
    assert all("a2a_waits" not in rec for rec in records(plain))


def test_1f1b_without_micro_batches_refused_in_one_line(tmp_path):
    out = train(TINY + ["parallel.a2a_overlap=1f1b", "parallel.dp=2", "parallel.ep=2",
                        f"run.dir={tmp_path / 'r'}"], tmp_path, nproc=2, check=False)
    assert out.returncode != 0
    assert "parallel.a2a_overlap=1f1b runs one micro-batch's forward beside another's backward, " \
           "but train.micro_batch_size=0 gives 1 micro-batch per step" in out.stdout + out.stderr, \
        (out.stdout + out.stderr)[-2000:]


def test_1f1b_inside_the_pipeline_same_losses_as_the_plain_schedule(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=4", "parallel.pp=2",
                     "parallel.dp=2", "parallel.ep=2", "parallel.microbatches=4", "moe.every=1",
                     "model.n_layers=4", "parallel.pp_schedule=dualpipev", "model.tie_embeddings=false",
                     "checkpoint.every=0", "checkpoint.at_end=false", "log.tensorboard=false",
                     "log.progress=none"]
    plain, inter = tmp_path / "plain", tmp_path / "inter"
    train(common + [f"run.dir={plain}"], tmp_path, nproc=4)
    train(common + [f"run.dir={inter}", "parallel.a2a_overlap=1f1b"], tmp_path, nproc=4)
    ref, got = losses(plain), losses(inter)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    assert got == ref
    for rec in records(inter)[1:]:  # (the first step also runs torch's shape-inference forward)
        # rank 0 holds the V's stages 0 and 3, one MoE block each: 2 x 4 micro-batches x 4
        # exchanges; it hands over inside its pairs
        assert rec["a2a_waits"] == 32 and rec["a2a_handed"] >= 2, rec
    refused = [a for a in common if not a.startswith("parallel.pp_schedule=")]
    out = train(refused + ["parallel.pp_schedule=1f1b", "parallel.a2a_overlap=1f1b",
                           f"run.dir={tmp_path / 'r'}"], tmp_path, nproc=4, check=False)
    assert out.returncode != 0
    assert "inside parallel.pp_schedule=1f1b each pair's forward output leaves after the " \
           "backward's interleaved pieces" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]
