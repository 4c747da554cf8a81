"""Process-group setup from the torchrun environment; device and backend from what exists.

One process (no WORLD_SIZE in the environment, or WORLD_SIZE=1) needs no process group.
Under torchrun each rank uses cuda:LOCAL_RANK with NCCL when CUDA is there, else the CPU
with gloo. Nothing here is global: the returned DistContext is passed around.
"""
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.mesh import default_device_type


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str          # "" when running as a single process without a process group
    store: object = field(default=None, compare=False)  # this attempt's rendezvous store (heartbeats)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend != ""


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def choose_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" and not torch.cuda.is_available():
        from .config import ConfigError  # a config problem: one line, no traceback
        raise ConfigError("run.device='cuda' but CUDA is not available; use run.device='auto' or 'cpu'")
    if kind == "cuda" or (kind == "auto" and default_device_type() == "cuda"):
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA "
                             f"device(s); start at most that many processes per node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_kind: str = "auto", timeout_s: int = 300,
                     group_of_one: bool = False) -> DistContext:
    """The process group of this run (torchrun's environment), or none in one process;
    group_of_one: a process group of this one process all the same (parallel.param_dtype=bf16:
    its fp32 masters live in ZeRO slices, which take their group)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(device_kind, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if world == 1 and not dist.is_initialized():
        if not group_of_one:
            return DistContext(0, 1, 0, device, "")
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return DistContext(0, 1, 0, device, backend)
    store = None
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_safe_store(timeout) or env_store(timeout, world)
        dist.init_process_group(backend=backend, timeout=timeout, store=store,
                                rank=int(os.environ["RANK"]), world_size=world)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, store)


def env_store(timeout, world: int):
    """What env:// init builds (rank 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT), built here
    so the run keeps a handle on it (heartbeats)."""
    rank = int(os.environ["RANK"])
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0, timeout=timeout)


def restart_safe_store(timeout):
    """The store of this worker group under torchrun's shared rendezvous store, or None.

    With `--standalone` (or any c10d rendezvous whose TCP store is shared with the workers,
    TORCHELASTIC_USE_AGENT_STORE=True) torchrun keeps ONE store server for every restart
    attempt, and torch's env:// init connects to it without a per-attempt prefix. A restarted
    group then reads the previous attempt's gloo addresses under the same keys and hangs in
    connectFullMesh (upstream pytorch 167288, 135712). Keying everything (the default group,
    every subgroup and mesh built on it) under the attempt number
    (TORCHELASTIC_RESTART_COUNT) gives each attempt keys of its own on the same server.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # a store of its own per launch (or no torchrun): env:// is safe
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    server = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"moekit/attempt_{attempt}", server)


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def shutdown(ctx: DistContext, ok: bool = True) -> None:
    """Tear the process group down. After a success every rank is here, and a barrier first
    avoids a rare gloo abort at exit (docs/torch_distributed_traps.md, trap 2). After an
    error the other ranks may be blocked in some other collective (or gone): a barrier would
    wait for run.dist_timeout_s,
    so the group is dropped at once and this process exits; the peers' next collective then
    fails on the closed connection (and torchrun stops the rest)."""
    if not (ctx.distributed and dist.is_initialized()):
        return
    if ok:
        dist.barrier()
        dist.destroy_process_group()
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - already failing; the first error is the one to report
        pass


def lost_peer(e: BaseException) -> bool:
    """True for the error a collective raises because another rank's process went away
    (a consequence of that rank's failure, not a cause)."""
    text = str(e)
    return isinstance(e, (dist.DistBackendError, dist.DistNetworkError, RuntimeError)) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                            "Socket closed"))


def all_agree(ctx: DistContext, ok: bool) -> bool:
    """True only if `ok` holds on every rank (so all ranks take the same branch)."""
    if not ctx.distributed:
        return ok
    flag = torch.tensor([0 if ok else 1], device=ctx.device)
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def any_rank(ctx: DistContext, flags: list, host_group=None) -> list:
    """Each flag True if it is True on any rank: one small all-reduce, so every rank takes the
    same branch (skip a step, stop) whatever it saw locally. host_group: a gloo group over
    which the flags go as a CPU tensor, between the hosts only (nothing waits for the device);
    None: the default group, on the run's device."""
    if not ctx.distributed:
        return [bool(f) for f in flags]
    device = "cpu" if host_group is not None else ctx.device
    t = torch.tensor([1 if f else 0 for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group)
    return [bool(v) for v in t.tolist()]
