"""Two torchrun agents as two nodes on this machine: c10d rendezvous, `--nnodes 1:2`, two
workers each, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a node that left can join again only with
a store per rendezvous round: trainer/membership.py), layout dp=-1 x ep=2 x ZeRO-1.

- Node B's agent and workers are killed with SIGKILL. Node A's agent restarts its workers at
  world 2; they resume from the last checkpoint and one line names the node that left, the
  world change and the step.
- Node B is started again. Its agent waits in the rendezvous, node A's agent stops its workers
  (SIGTERM: they finish the step and save a checkpoint) and every worker starts at world 4 from
  that checkpoint. One line names the node that joined.
- After 10 steps at world 4 both agents get SIGTERM (the run is stopped by events, not by a
  step count a loaded machine could reach before the node returns); every step up to the
  last is logged once. The losses equal an uninterrupted 2-process run of the same config
  within 1e-5 relative for the first DRIFT_FREE steps after the shrink: the layouts (dp4 x ep2
  and dp2 x ep2 over the same global batch) differ in reduction order only. Measured worst
  over 600 steps of such a run: 2.3e-7; but how many steps run at world 2 depends on how fast
  the loaded machine reaches the rejoin, and once Adam turns a rounding difference into a
  flipped step (tests/tolerance.py rule 5) fp32 runs drift apart: a CI run spent 233 steps at
  world 2 and drifted to 1.8e-3 from step 206 on (1e-5 held to step 205). Every step is
  therefore held to DRIFT, the steps up to DRIFT_FREE after the shrink to 1e-5.
- The run started again on one process, where ep=2 cannot form, is refused in one line that
  names the world change and the fix.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.e2e.launch import command, prepared_cache
from tests.e2e.test_train import ROOT, TINY, close, losses, records

pytestmark = pytest.mark.e2e
STEPS = 2000  # the schedule's length; the test stops the run by signal
DRIFT_FREE, DRIFT = 100, 1e-2   # see the module docstring (drift measured 1.8e-3 at 230 steps)
COMMON = TINY + ["train.eval_every=0", "log.moe_stats_every=0", "checkpoint.every=10",
                 f"train.steps={STEPS}", "parallel.dp=-1", "parallel.ep=2", "parallel.zero=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _nodes(run):
    try:
        return json.loads((run / "nodes.json").read_text())
    except (OSError, ValueError):
        return None


def _logged(run) -> list:
    """The steps in metrics.jsonl so far (a line being written is skipped)."""
    out = []
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return out


def _stop(procs, what: str) -> None:
    """SIGTERM all at once (an agent left running would restart its workers at the smaller
    world): the workers finish their step and save, then every process exits."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    try:
        for proc in procs:
            proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what} did not stop within 120 s of SIGTERM") from None


def _checkpoint_steps(run) -> list:
    return sorted(int(p.parent.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*/COMPLETE"))


def _wait(what: str, ok, procs, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not ok():
        assert all(p.poll() is None for p in procs), f"an agent ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.1)


def _kill_node(agent) -> None:
    """SIGKILL an agent and its workers (torchrun starts each worker in a session of its own)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent.pid)], capture_output=True, text=True)
    for pid in [agent.pid] + [int(p) for p in out.stdout.split()]:
        os.kill(pid, signal.SIGKILL)
    agent.wait()


@pytest.mark.long
def test_a_node_lost_and_regained(tmp_path, tmp_path_factory):
    cache = prepared_cache(tmp_path_factory, "elastic_cache", TINY)
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    ref, run = tmp_path / "ref", tmp_path / "run"
    common = COMMON + [f"data.cache_dir={cache}"]
    port = _free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
             "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=10", "--max-restarts", "3", "train.py", *common,
             f"run.dir={run}", "train.resume=true"]
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("a", "b", "b2")}

    def start(name):
        return subprocess.Popen(agent, cwd=ROOT, env=env, stdout=logs[name], stderr=subprocess.STDOUT)

    node_a = start("a")
    procs = [node_a]
    try:
        _wait("rendezvous store on node A", lambda: _listening(port), procs, 60)  # A hosts it
        node_b = start("b")
        procs.append(node_b)
        _wait("world 4 with a checkpoint", lambda: (_nodes(run) or {}).get("world") == 4
              and _checkpoint_steps(run), procs)
        _kill_node(node_b)
        procs.remove(node_b)
        _wait("the shrink to world 2", lambda: (_nodes(run) or {}).get("world") == 2, procs)
        resumed_small = _nodes(run)["step"]
        _wait("a checkpoint at world 2", lambda: _checkpoint_steps(run)[-1] > resumed_small, procs)
        node_b2 = start("b2")
        procs.append(node_b2)
        _wait("the growth to world 4", lambda: (_nodes(run) or {}).get("world") == 4
              and _nodes(run)["step"] > resumed_small, procs)
        resumed_large = _nodes(run)["step"]
        _wait("10 steps at world 4", lambda: max(_logged(run), default=0) >= resumed_large + 10, procs)
        _stop([node_a, node_b2], "the agents")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    last = max(_logged(run))
    ref_job = subprocess.Popen(command(common + [f"run.dir={ref}"], nproc=2), cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        _wait("the reference run", lambda: max(_logged(ref), default=0) >= last, [ref_job], 300)
        _stop([ref_job], "the reference run")
    finally:
        if ref_job.poll() is None:
            ref_job.kill()
    out = ""
    for name in ("a", "b2"):  # rank 0 (which prints the lines) may sit on either node once B2
        logs[name].seek(0)    # has joined: the rendezvous orders the agents as it likes
        out += logs[name].read()
    changed = [line for line in out.splitlines() if line.startswith("nodes changed:")]
    left = [line for line in changed if " left; " in line]
    joined = [line for line in changed if " joined; " in line]
    assert len(left) == 1 and len(joined) == 1 and len(changed) == 2, out[-4000:]
    assert f":{node_b.pid} (was ranks 2-3) left; world 4 -> 2 processes on 1 node(s); " \
           f"resuming from step {resumed_small}" in left[0], changed
    assert f":{node_b2.pid} (now ranks " in joined[0] and " joined; world 2 -> 4 processes on 2 " \
           f"node(s); resuming from step {resumed_large}" in joined[0], changed
    assert resumed_small % 10 == 0 and resumed_small < resumed_large < last
    assert "preempted: stopped by SIGTERM" in out
    assert [r["step"] for r in records(run)] == list(range(1, last + 1))  # each step once
    got, want = losses(run), losses(ref)
    early = [s for s in got if s <= resumed_small + DRIFT_FREE]
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in early)
    assert all(close(got[s], want[s], 1e-5) for s in early), worst
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    assert all(close(got[s], want[s], DRIFT) for s in got), worst

    # one process cannot hold ep=2: refused in one line naming the world change and the fix
    before = (run / "nodes.json").read_text()
    out = subprocess.run(command(common + [f"run.dir={run}", "train.resume=true"]), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert "parallel.ep=2 must divide" in lines[0] and "last trained on 4 processes and now has 1" \
        in lines[0] and "parallel.dp=-1" in lines[0], lines
    assert (run / "nodes.json").read_text() == before
