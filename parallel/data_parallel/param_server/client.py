"""The worker's side of the parameter server: pull before forward, push after backward.

Layout (parallel.ps_servers = S): every rank is a worker with a full model replica; ranks
0..S-1 also host one server shard each, served by their RPC threads beside the worker (so
the default process group stays whole for set-up, evaluation and checkpoints). Server state
(fp32 masters, optimizer state) lives in host memory, as in ZeRO-Offload; gradients travel
to it as host tensors.

Sparse push: an expert row whose gradient is all zero on this worker (no token of its share
was routed there) is not sent; the shard counts it as a zero gradient. Pulls are dense: the
optimizer's moments and weight decay move every expert every step, so an expert a worker
did not touch still changed, and skipping it would give the worker stale weights (not the
one-process function). Bytes are counted per step: `take_traffic()`.
"""
import math
import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from .server import ServerShard, host, rpc_call, unhost
from ...kinds import expert_param_names
from .units import assign, make_units, unit_view


TRAFFIC = ("pull", "push", "push_dense", "push_expert", "push_expert_dense")


def shard_name(s: int) -> str:
    return f"ps{s}"


def worker_name(rank: int) -> str:
    return f"w{rank}"


class PSClient:
    def __init__(self, model, shards: list, rank: int, workers: int, staleness: int):
        self.params = dict(model.named_parameters())
        self.shards, self.rank, self.workers, self.staleness = shards, rank, workers, staleness
        self.experts = expert_param_names(model) & set(self.params)
        self.traffic = Counter()

    # ------------------------------------------------------------------ per step
    def pull(self, step: int) -> int:
        """Copy the masters into the model once step `step` may run; -> the staleness seen."""
        futs = self._call_all("pull", self.rank, step)
        lag = 0
        with torch.no_grad():
            for s, fut in enumerate(futs):
                tensors, seen = _wait(fut, s, step, "pull")
                lag = max(lag, seen)
                for u in self.shards[s]:
                    unit_view(self.params[u.name], u).copy_(tensors[u.key])
                self.traffic["pull"] += sum(t.numel() * t.element_size() for t in tensors.values())
        return lag

    def push(self, step: int, lr: float, loss: torch.Tensor, aux: torch.Tensor, max_norm: float,
             stop: bool = False):
        """Send this worker's gradients (and whether it was asked to stop) -> (loss, aux, grad
        norm, skipped, stop_at). s = 0: the mean loss and the norm of the mean gradient over
        all workers (clipped as one process clips); s > 0: this worker's own, its gradient
        clipped locally. stop_at: the step every worker stops after, once any asked
        (ServerShard.stop_step, read from shard 0), else None."""
        loss_aux = torch.stack([loss.detach(), aux.detach()]).double().cpu()
        if self.staleness > 0:
            norm = self._local_norm()
            skip = not (math.isfinite(norm) and bool(torch.isfinite(loss_aux).all()))
            coef = _clip_coef(norm, max_norm)
            futs = self._send(step, lr, loss_aux, coef, skip, stop)
            replies = [_wait(f, s, step, "push") for s, f in enumerate(futs)]
            return loss_aux[0].item(), loss_aux[1].item(), norm, skip, _stop_at(replies[0])
        futs = self._send(step, lr, loss_aux, 1.0, False, stop)
        replies = [_wait(f, s, step, "push") for s, f in enumerate(futs)]
        sq = sum(float(r[0]) for r in replies)
        mean_loss, mean_aux = float(replies[0][1]), float(replies[0][2])
        norm = math.sqrt(sq)
        skip = not all(math.isfinite(v) for v in (norm, mean_loss, mean_aux))
        coef = _clip_coef(norm, max_norm)
        futs = self._call_all("skip", step) if skip else \
            self._call_all("apply", step, coef)
        for s, f in enumerate(futs):
            _wait(f, s, step, "apply")
        return mean_loss, mean_aux, norm, skip, _stop_at(replies[0])

    def take_traffic(self) -> dict:
        """Bytes since the last call: pull, push, push_dense (had every row been sent),
        push_expert / push_expert_dense (their expert rows)."""
        out = {k: self.traffic[k] for k in TRAFFIC}
        self.traffic = Counter()
        return out

    # ------------------------------------------------------------------ checkpoints
    def fetch_state(self, optimizer) -> None:
        """Masters into the model, optimizer state into `optimizer` (same parameters), so an
        ordinary checkpoint of this replica is the parameter server's state."""
        from ..offload import step_at_zero_lr
        if not optimizer.state:
            step_at_zero_lr(optimizer)
        futs = self._call_all("state")
        with torch.no_grad():
            for s, fut in enumerate(futs):
                masters, states = fut.wait()
                for u in self.shards[s]:
                    p = self.params[u.name]
                    unit_view(p, u).copy_(masters[u.key])
                    for k, v in states[u.key].items():
                        _set_state(optimizer.state[p], k, v, p, u)

    def server_traffic(self) -> list:
        """[(bytes in, bytes out)] of every shard since the start."""
        return [f.wait() for f in self._call_all("traffic")]

    # ------------------------------------------------------------------ internals
    def _local_norm(self) -> float:
        sq = sum(float(p.grad.float().pow(2).sum()) for p in self.params.values() if p.grad is not None)
        return math.sqrt(sq)

    def _send(self, step, lr, loss_aux, coef: float, skip: bool, stop: bool = False) -> list:
        """One push per shard; expert rows this worker did not touch stay home."""
        touched = {n: (self.params[n].grad.reshape(self.params[n].shape[0], -1) != 0).any(1).tolist()
                   for n in self.experts if self.params[n].grad is not None}
        futs = []
        for s, units in enumerate(self.shards):
            grads = {}
            for u in units:
                g = self.params[u.name].grad
                if g is None:
                    continue
                view = unit_view(g, u)
                size = view.numel() * 4   # sent as fp32
                self.traffic["push_dense"] += size
                if u.expert >= 0:
                    self.traffic["push_expert_dense"] += size
                if skip or (u.expert >= 0 and not touched[u.name][u.expert]):
                    continue
                grads[u.key] = view.detach().float().mul(coef).cpu()
                self.traffic["push"] += size
                if u.expert >= 0:
                    self.traffic["push_expert"] += size
            futs.append(self._call(s, "push", self.rank, step, grads, lr, loss_aux, skip, stop))
        return futs

    def _call(self, s: int, method: str, *args):
        """ServerShard.<method>(*args) on shard s, asynchronously -> its future."""
        return rpc.rpc_async(worker_name(s), rpc_call, args=(shard_name(s), method, *args))

    def _call_all(self, method: str, *args) -> list:
        return [self._call(s, method, *args) for s in range(len(self.shards))]


def _wait(fut, s: int, step: int, what: str):
    """fut's value; a failed call (the shard's rank died or stopped) as one line naming it."""
    try:
        return fut.wait()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"parameter server: rank {s} (host of shard {shard_name(s)}) failed "
                           f"the {what} of step {step} ({first}); the run stops -- resume from "
                           f"the last checkpoint with train.resume=true") from None


def _stop_at(reply) -> "int | None":
    """The agreed stop step at the end of shard 0's push reply (-1: none)."""
    v = int(reply[-1])
    return None if v < 0 else v


def _clip_coef(norm: float, max_norm: float) -> float:
    """One process's clip factor (parallel/grads.py clip_): min(1, max_norm / (norm + 1e-6))."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def _set_state(state: dict, key: str, value, param, unit) -> None:
    if isinstance(value, torch.Tensor) and unit.expert >= 0 and isinstance(state.get(key), torch.Tensor) \
            and state[key].shape == param.shape:
        state[key][unit.expert].copy_(value)
    elif isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
        state[key].copy_(value.to(state[key].device).reshape(state[key].shape))
    else:
        state[key] = value


# ---------------------------------------------------------------------- start / stop
def start(model, optimizer, servers: int, staleness: int, rank: int, world: int,
          init_method: str = "env://", per_expert: bool = True, first_step: int = 1) -> PSClient:
    """Collective over all ranks: host this rank's shard (ranks < servers), start RPC, return
    this worker's client. The model and optimizer hold the values to start from (fresh or
    loaded from a checkpoint) and are the same on every rank. per_expert: shard expert
    tensors per expert (AdamW; Adafactor scales by whole-tensor RMS, so its expert tensors
    stay whole). first_step: the first step to run (a resumed run's checkpoint step + 1)."""
    shards = assign(make_units(model, per_expert), servers)
    if rank < servers:
        host(shard_name(rank), ServerShard(shards[rank], dict(model.named_parameters()),
                                           optimizer, world, staleness, first_step))
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=1800,
                                           num_worker_threads=max(16, 4 * world))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's own deprecation noise from the rendezvous
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world, rpc_backend_options=opts)
    if dist.is_initialized():
        dist.barrier()
    return PSClient(model, shards, rank, world, staleness)


def stop(rank: int, servers: int, graceful: bool = True) -> None:
    """graceful (collective): wait for every rank's outstanding calls, then shut RPC down.
    After an error on this rank graceful=False: the other ranks may never get there, and a
    graceful shutdown would wait for them forever, hiding the error."""
    rpc.shutdown(graceful=graceful)
    if rank < servers:
        unhost(shard_name(rank))


def default_init_method() -> str:
    """torchrun's rendezvous (MASTER_ADDR/MASTER_PORT) as RPC's; one process without torchrun:
    a free loopback port."""
    if "MASTER_ADDR" in os.environ:
        return "env://"
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"
