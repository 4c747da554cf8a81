"""train.step_checks=device under torchrun on 2 gloo processes, dp2 x ep2
(configs/layout_ep2_dp2.toml) and tp2 (DTensor parameters: the step's rate and verdict taken
as replicated scalars): the non-finite guard decided on the device (the verdict all-reduced there, fused AdamW's found_inf), the
values read every 3 steps (log.every), against the host mode's check every step. Same layout,
same kernels, the router bias moving every step: every logged loss, aux loss, gradient norm
and learning rate of 6 steps is equal exactly."""
import pytest

from tests.e2e.test_train import TINY, cache, records, train  # noqa: F401 - cache is a fixture

pytestmark = pytest.mark.e2e


# (1f1b: the all-to-all's exposed wait, timed by CUDA events on a GPU, is read with the held
# values; here on gloo it is the host's wait, a float in every record either way)
@pytest.mark.parametrize("layout", [["parallel.dp=2", "parallel.ep=2"], ["parallel.dp=1", "parallel.tp=2"],
                                    ["parallel.dp=2", "parallel.ep=2", "parallel.a2a_overlap=1f1b",
                                     "train.micro_batch_size=2"]],
                         ids=["dp2_ep2", "tp2", "dp2_ep2_1f1b"])
def test_device_checks_equal_host_checks(tmp_path, cache, layout):
    common = TINY + [f"data.cache_dir={cache}", "train.steps=6", *layout,
                     "log.every=3", "checkpoint.every=0", "moe.bias_update_rate=0.01",
                     "train.optimizer_impl=fused", "log.moe_stats_every=0"]
    got = {}
    for checks in ("host", "device"):
        run = tmp_path / checks
        out = train(common + [f"run.dir={run}", f"train.step_checks={checks}"], tmp_path, nproc=2)
        assert f"step checks: {checks} (train.step_checks={checks}" in out.stdout, out.stdout[-2000:]
        got[checks] = [{k: r[k] for k in ("step", "loss", "aux_loss", "grad_norm", "lr", "skipped")}
                       for r in records(run)]
        if "parallel.a2a_overlap=1f1b" in layout:
            assert all(isinstance(r["a2a_exposed_s"], float) and r["a2a_waits"] > 0
                       for r in records(run)), records(run)
    assert [r["step"] for r in got["device"]] == [1, 2, 3, 4, 5, 6]
    assert got["host"] == got["device"]


def test_sigterm_under_device_checks_reads_and_saves_at_once(tmp_path, cache):
    """log.every=100000: no step would be read before the end, but a SIGTERM, agreed between
    the hosts every step, makes its step a read: every held step is logged, the checkpoint
    of that step saved, and a resume continues from it (the preemption contract of
    tests/e2e/test_preemption.py, held under train.step_checks=device)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from tests.e2e.test_train import ROOT
    run = tmp_path / "run"
    common = TINY + [f"data.cache_dir={cache}", f"run.dir={run}", "parallel.dp=2", "checkpoint.every=0",
                     "checkpoint.at_end=false", "train.step_checks=device", "log.every=100000",
                     "log.moe_stats_every=0"]
    train(common + ["train.steps=1", f"run.dir={tmp_path / 'warm'}"], tmp_path, nproc=2)  # the data cache
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", "train.py", *common, "train.steps=100000"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(4)  # some steps held, none read
        assert not (run / "metrics.jsonl").read_text()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    steps = [r["step"] for r in records(run)]
    last = steps[-1]
    assert last > 1 and steps == list(range(1, last + 1)), steps
    assert f"preempted: stopped by SIGTERM after step {last}; checkpoint" in err, err[-3000:]
    assert (run / "checkpoints" / f"step_{last:08d}" / "COMPLETE").is_file()
    train(common + ["train.resume=true", f"train.steps={last + 2}"], tmp_path, nproc=2)
    assert [r["step"] for r in records(run)] == list(range(1, last + 3))
