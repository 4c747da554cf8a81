"""parallel.param_dtype=bf16 through train.py (bf16 parameters and gradients, fp32 masters in
ZeRO-1/2 slices; tests/dist/test_param_dtype.py holds the arithmetic to a hand-written
reference):
- one process (a process group of one holds the ZeRO-1 slices) with the batch in two
  micro-batches equals dp2 x ZeRO-2 over 6 steps within 1e-5 relative: both sum the two halves'
  bf16 gradients once (accumulation; the reduce-scatter) and halve them (exactly, a power of 2);
- the one-process step-3 checkpoint holds the fp32 masters (not bf16 copies) and resumes
  under dp2 x ZeRO-3 (FSDP2's fp32 shards the masters, bf16 gathers) with the uninterrupted
  run's losses (1e-4: ZeRO-3 clips the fp32 gradient shards FSDP2 hands over, ZeRO-1/2 the
  bf16 gradients they hold, a different rounding; measured 1.2e-5 at step 5);
- `checkpoint.init_from` under dp2 x ZeRO-1, bf16 and fp32, with lr=1e-30: the run's
  checkpoint after 2 steps holds the weights it loaded (within 1e-12) (the master slices take the loaded values;
  before, the first step's all-gather wrote the random initialisation back)."""
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.e2e.launch import prepared_cache, run_all
from tests.e2e.test_train import TINY, close, losses, train

pytestmark = [pytest.mark.e2e, pytest.mark.lowp]
BF16 = ["parallel.precision=bf16", "parallel.param_dtype=bf16"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return prepared_cache(tmp_path_factory, "param_dtype_cache", TINY)


@pytest.mark.long
def test_bf16_parameters_through_train_py(tmp_path, cache):
    common = TINY + BF16 + [f"data.cache_dir={cache}", "train.steps=6", "checkpoint.every=3",
                            "log.moe_stats_every=0"]
    one, dp2 = tmp_path / "one", tmp_path / "dp2"
    results = run_all([(1, common + [f"run.dir={one}", "parallel.zero=1", "train.micro_batch_size=4"]),
                       (2, common + [f"run.dir={dp2}", "parallel.dp=2", "parallel.zero=2"])], tmp_path)
    for code, log in results:
        assert code == 0, log[-3000:]
    ref, got = losses(one), losses(dp2)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6] and ref[6] < ref[1]
    for step in ref:
        assert close(got[step], ref[step], 1e-5), (step, got[step], ref[step])

    ckpt = one / "checkpoints" / "step_00000003"
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    dtypes = {str(v.properties.dtype) for k, v in meta.items() if k.startswith("model.")}
    assert dtypes == {"torch.float32"}, dtypes  # the masters, not the bf16 parameters

    shutil.rmtree(one / "checkpoints" / "step_00000006")
    train(common + [f"run.dir={one}", "train.resume=true", "parallel.dp=2", "parallel.zero=3"],
          tmp_path, nproc=2)
    resumed = losses(one)
    for step in (4, 5, 6):
        assert close(resumed[step], ref[step], 1e-4), (step, resumed[step], ref[step])

    # init_from under ZeRO-1 (bf16 masters from the checkpoint; fp32: the slices refreshed)
    # with lr=1e-30 (below every weight's fp32 spacing; lr must be > 0): the run's checkpoint
    # after 2 steps must hold the weights it started from
    runs = {dtype: tmp_path / f"init_{dtype}" for dtype in ("bf16", "fp32")}
    results = run_all([(2, TINY + (BF16 if dtype == "bf16" else []) + [
        f"data.cache_dir={cache}", "train.steps=2", "log.moe_stats_every=0", "train.lr=1e-30",
        f"run.dir={run}", f"checkpoint.init_from={ckpt}", "parallel.dp=2", "parallel.zero=1"])
        for dtype, run in runs.items()], tmp_path)
    for code, log in results:
        assert code == 0, log[-3000:]
    want = _model_tensors(ckpt, tmp_path / "source.pt")
    for dtype, run in runs.items():
        got = _model_tensors(run / "checkpoints" / "step_00000002", tmp_path / f"{dtype}.pt")
        assert got.keys() == want.keys()
        changed = [k for k in want if not torch.allclose(got[k], want[k], rtol=0, atol=1e-12)]
        assert not changed, (dtype, changed[:3])


def _model_tensors(ckpt, out) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(ckpt), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False)["model"].items() if torch.is_tensor(v)}
