"""train.step_checks=device under torchrun, dp2 x ep2 (configs/layout_ep2_dp2.toml) on 2 gloo processes: the non-finite
guard decided on the device (the verdict all-reduced there, fused AdamW's found_inf), the
values read every 3 steps (log.every), against the host mode's check every step. Same layout,
same kernels, the router bias moving every step: every logged loss, aux loss, gradient norm
and learning rate of 6 steps is equal exactly."""
import pytest

from tests.e2e.test_train import TINY, cache, records, train  # noqa: F401 - cache is a fixture

pytestmark = pytest.mark.e2e


def test_device_checks_equal_host_checks_under_dp2_ep2(tmp_path, cache):
    common = TINY + [f"data.cache_dir={cache}", "parallel.dp=2", "parallel.ep=2", "train.steps=6",
                     "log.every=3", "checkpoint.every=0", "moe.bias_update_rate=0.01",
                     "train.optimizer_impl=fused", "log.moe_stats_every=0"]
    got = {}
    for checks in ("host", "device"):
        run = tmp_path / checks
        out = train(common + [f"run.dir={run}", f"train.step_checks={checks}"], tmp_path, nproc=2)
        assert f"step checks: {checks} (train.step_checks={checks}" in out.stdout, out.stdout[-2000:]
        got[checks] = [{k: r[k] for k in ("step", "loss", "aux_loss", "grad_norm", "lr", "skipped")}
                       for r in records(run)]
    assert [r["step"] for r in got["device"]] == [1, 2, 3, 4, 5, 6]
    assert got["host"] == got["device"]
