"""Spawn N real processes with a process group, run a function in each, collect results.

    from tests.dist.harness import run_distributed
    outs = run_distributed(fn, world_size, *args, timeout=120)

Workers are forked from a forkserver that has imported torch and this project's packages
once per test session (PRELOAD), so a worker starts in a fraction of a second instead of
importing torch again (4-5 s of CPU each on the 2-core machine; world 8 paid it 8 times).
Nothing is imported into the server beyond modules, so workers start as cleanly as spawned
ones (no CUDA context, no threads). Each worker: torch.set_num_threads(1) (the processes
otherwise oversubscribe the cores), init_process_group (nccl when there is one CUDA device
per rank, else gloo) with a short timeout, ``fn(rank, world_size, *args)``, then barrier + destroy_process_group
(the barrier avoids a rare abort at exit seen on gloo). ``fn`` and ``args`` must be
picklable, so ``fn`` must live at module level.

Results and tracebacks travel through files in a temporary directory rather than a
multiprocessing queue: tensors sent through a torch queue are shared-memory handles that
die with the sender. The rendezvous is a FileStore in the same directory, so there is
no port to race for. The directory is removed afterwards.

On the first failure (an exception in ``fn``, a crashed worker, or the wall-clock
``timeout``) the remaining workers are terminated, since they would otherwise block in a
collective until the process-group timeout, and the parent raises with the worker's
traceback.
"""

import datetime
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist

__all__ = ["run_distributed", "DistributedTestError"]

PRELOAD = [  # imported once by the forkserver; a failed import only costs its time"torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
           "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "moe", "models", "parallel", "trainer.run", "optim"]


class DistributedTestError(RuntimeError):
    """A worker of run_distributed failed; the message carries its traceback."""


def _backend_and_device(rank: int, world_size: int) -> tuple[str, torch.device]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        torch.cuda.set_device(rank)
        return "nccl", torch.device("cuda", rank)
    return "gloo", torch.device("cpu")


def _paths(tmp: str, rank: int) -> dict[str, str]:
    return {
        "result": os.path.join(tmp, f"result_{rank}.pt"),
        "error": os.path.join(tmp, f"error_{rank}.txt"),
        "done": os.path.join(tmp, f"done_{rank}"),
    }


def _worker(rank, world_size, tmp, pg_timeout_s, fn, args):
    torch.set_num_threads(1)
    paths = _paths(tmp, rank)
    try:
        backend, _ = _backend_and_device(rank, world_size)
        dist.init_process_group(
            backend,
            init_method="file://" + os.path.join(tmp, "store"),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, paths["result"])
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, incl. KeyboardInterrupt
        with open(paths["error"] + ".part", "w") as f:
            f.write(traceback.format_exc())
        os.replace(paths["error"] + ".part", paths["error"])  # readers never see half a file
        # Do not enter the barrier: the others are terminated by the parent.
        os._exit(1)
    open(paths["done"], "w").close()


def _first_error(tmp: str, world_size: int) -> tuple[int, str] | None:
    """(rank, traceback) of the earliest error file: the root cause, since the other ranks
    fail only afterwards (e.g. gloo 'connection closed' once the failed rank has exited)."""
    found = []
    for r in range(world_size):
        p = _paths(tmp, r)["error"]
        if os.path.exists(p):
            with open(p) as f:
                found.append((os.stat(p).st_mtime_ns, r, f.read()))
    if not found:
        return None
    _, rank, tb = min(found)
    return rank, tb


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _wait(procs, tmp: str, timeout: float) -> None:
    """Return when all workers exited cleanly; raise on the first failure or timeout."""
    deadline = time.monotonic() + timeout
    world_size = len(procs)
    while True:
        err = _first_error(tmp, world_size)
        if err is not None:
            _stop(procs)
            # Another rank may have failed first and caused this one; report all we have.
            rank, tb = err
            raise DistributedTestError(f"rank {rank} of {world_size} failed:\n{tb}")
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and not _finished(tmp, r):
                time.sleep(0.2)  # let a racing error file land first
                if _first_error(tmp, world_size) is not None:
                    break
                _stop(procs)
                raise DistributedTestError(
                    f"rank {r} of {world_size} died with exit code {p.exitcode} "
                    "before reporting a Python error (import failure at spawn, segfault, "
                    "OOM, abort?); see its stderr above")
        else:
            if all(p.exitcode is not None for p in procs):
                return
            if time.monotonic() > deadline:
                _stop(procs)
                raise DistributedTestError(
                    f"timed out after {timeout:.0f}s with world_size={world_size}; "
                    "a rank is probably stuck in a collective the others never entered")
            time.sleep(0.05)


def _finished(tmp: str, rank: int) -> bool:
    paths = _paths(tmp, rank)
    if not os.path.exists(paths["done"]):
        return False
    # Finished its work and teardown; a crash at interpreter exit does not fail the test.
    warnings.warn(f"rank {rank} crashed at interpreter exit after finishing cleanly")
    return True


def run_distributed(fn, world_size: int, *args, timeout: float = 120):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    Returns the list of per-rank return values (each must be picklable by torch.save).
    ``timeout`` (seconds) bounds the whole run and is also the process-group timeout.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if getattr(fn, "__qualname__", "").count("<locals>") or getattr(fn, "__name__", "") == "<lambda>":
        raise ValueError(
            f"fn={fn!r} is a lambda or nested function; spawned workers cannot unpickle it. "
            "Define it at module level.")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    tmp = tempfile.mkdtemp(prefix="moekit_dist_")
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker, args=(rank, world_size, tmp, timeout, fn, args),
                            daemon=True)
            p.start()
            procs.append(p)
        _wait(procs, tmp, timeout)
        return [torch.load(_paths(tmp, r)["result"], weights_only=False)
                for r in range(world_size)]
    finally:
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
