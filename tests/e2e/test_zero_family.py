"""The ZeRO family through train.py (dp=2 ep=2, tiny MoE GPT).

- ZeRO-3 with offload=optimizer trains like one process (1e-4 relative, reduction order), its
  first-step model_state_bytes put the optimizer state (and the fp32 masters) on the host;
- its checkpoint resumes under other layouts and offload modes (ZeRO-1 offloaded, ZeRO-3
  offload=params) with the uninterrupted run's losses (1e-4): checkpoints hold no trace of
  offloading;
- qwZ + qgZ: every loss within 1% of the unquantized run, gather and reduce-scatter bytes in
  metrics.jsonl's comm_bytes <= 0.3x.
"""
import shutil

import pytest

from tests.e2e.test_train import TINY, close, losses, records, train

pytestmark = pytest.mark.e2e
EP2 = ["parallel.dp=2", "parallel.ep=2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


@pytest.mark.long
def test_offload_trains_like_one_process_and_checkpoints_move_between_modes(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "train.steps=4"]
    one, off = tmp_path / "one", tmp_path / "off"
    train(common + [f"run.dir={one}"], tmp_path)
    train(common + EP2 + [f"run.dir={off}", "parallel.zero=3", "parallel.offload=optimizer",
                          "checkpoint.every=2"], tmp_path, nproc=2)
    a, b = losses(one), losses(off)
    assert sorted(b) == [1, 2, 3, 4] and all(close(a[s], b[s], 1e-4) for s in a), (a, b)
    state = records(off)[0]["model_state_bytes"]
    assert set(state["optimizer"]) == {"cpu"} and state["optimizer"]["cpu"] > 0, state
    for i, layout in enumerate((["parallel.zero=1", "parallel.offload=optimizer"],
                                ["parallel.zero=3", "parallel.offload=params"])):
        resumed = tmp_path / f"resumed{i}"
        shutil.copytree(off / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
        train(common + EP2 + layout + [f"run.dir={resumed}", "train.resume=true"], tmp_path, nproc=2)
        c = losses(resumed)
        assert sorted(c) == [3, 4] and all(close(a[s], c[s], 1e-4) for s in c), (layout, a, c)


def test_quantized_collectives_stay_close_and_move_a_quarter_of_the_bytes(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "train.steps=4", "parallel.zero=3"] + EP2
    plain, quant = tmp_path / "plain", tmp_path / "quant"
    train(common + [f"run.dir={plain}"], tmp_path, nproc=2)
    train(common + [f"run.dir={quant}", "parallel.zeropp_quantize_weights=true",
                    "parallel.zeropp_quantize_grads=true"], tmp_path, nproc=2)
    a, b = losses(plain), losses(quant)
    assert all(close(a[s], b[s], 1e-2) for s in a), (a, b)
    for kind in ("zero_param_gather", "zero_grad_reduce_scatter"):
        ratio = records(quant)[-1]["comm_bytes"][kind] / records(plain)[-1]["comm_bytes"][kind]
        assert ratio <= 0.3, (kind, ratio)
