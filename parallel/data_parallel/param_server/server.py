"""One parameter-server shard: its units' fp32 masters in host memory, their optimizer, and
the consistency rule (Li et al., OSDI 2014: bulk-synchronous or bounded delay).

Workers reach a shard through torch.distributed.rpc. RPC calls module-level functions in the
callee, so each process keeps the shards it hosts in `_HOSTED` (name -> ServerShard); that
lookup is the only thing the module-level functions below read, it is filled by `host()` and
emptied by `unhost()`, and nothing else touches it.

Consistency, with W workers and staleness s:
  s = 0  push(step t) accumulates; when all W gradients of t are in, the shard holds their
         mean and answers every push with its squared norm (the workers sum the shards' and
         clip by the global norm, as one process does); apply(t, coef) then runs one
         optimizer step; pull(t + 1) waits for it. Same function as one process.
  s > 0  push applies the worker's (locally clipped) gradient at once as its own optimizer
         step; pull(t) waits until the slowest worker has pushed step t - 1 - s, so no worker
         runs more than s steps ahead of the slowest; it reports the staleness it saw,
         (t - 1) - (the slowest worker's last pushed step).
Missing expert units in a push (a worker routed no token to that expert) count as zero
gradients: the optimizer still steps them (AdamW's moments and decay move them), exactly as
one process steps the whole expert tensor.
"""
import threading

import torch
import torch.distributed.rpc as rpc

from .units import unit_view

_HOSTED = {}   # shard name -> ServerShard hosted by this process (see the docstring)


def host(name: str, shard) -> None:
    _HOSTED[name] = shard


def unhost(name: str) -> None:
    _HOSTED.pop(name, None)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ServerShard:
    def __init__(self, units: list, params: dict, optimizer, workers: int, staleness: int,
                 first_step: int = 1):
        """units: this shard's; params: {name: model parameter} (their current values and,
        through `optimizer`, the local optimizer whose hyperparameters and state are copied);
        first_step: the step the run starts at (> 1 when resumed from a checkpoint)."""
        self.units, self.workers, self.staleness = units, workers, staleness
        self.masters = {u.key: torch.nn.Parameter(unit_view(params[u.name], u).detach().float().cpu().clone())
                        for u in units}
        self.optimizer = _shard_optimizer(optimizer, units, params, self.masters)
        self.lock = threading.Condition()
        self.clock = [first_step - 1] * workers  # last step each worker pushed
        self.applied = first_step - 1            # s = 0: last step applied
        self.pending = {}                    # s = 0: step -> accumulated gradients
        self.waiting = []                    # (ready(), future, result()) parked pulls/pushes
        self.bytes_in = self.bytes_out = 0
        self.stop_at = None                  # the step every worker stops after (stop_step)

    # ------------------------------------------------------------------ rpc entry points
    def push(self, worker: int, step: int, grads: dict, lr: float, loss_aux: torch.Tensor,
             skip: bool = False, stop: bool = False):
        """s > 0 with skip: a non-finite gradient on that worker, no update (its clock moves).
        stop: that worker was asked to stop (SIGTERM): see stop_step. The reply ends with the
        agreed stop step (-1: none yet)."""
        fut = torch.futures.Future()
        with self.lock:
            self.bytes_in += _nbytes(grads.values())
            if stop and self.stop_at is None:
                self.stop_at = self.stop_step(step)
            if self.staleness > 0:
                if not skip:
                    self._step(grads, lr)
                self.clock[worker] = step
                fut.set_result(torch.cat([loss_aux.double(), self._stop_field()]))
                self._wake()
                return fut
            acc = self.pending.setdefault(step, {"grads": {}, "count": 0, "loss": torch.zeros(2), "lr": lr})
            for k, g in grads.items():
                have = acc["grads"].get(k)
                acc["grads"][k] = g.float().clone() if have is None else have.add_(g)
            acc["count"] += 1
            acc["loss"] += loss_aux
            self.clock[worker] = step
            self.waiting.append((lambda: acc["count"] == self.workers, fut, lambda: self._norm(step)))
            self._wake()
        return fut

    def apply(self, step: int, coef: float):
        """s = 0: the step's mean gradient times coef (clipping), one optimizer step. Every
        worker calls it with the same coef; the first call applies, the rest find it done."""
        fut = torch.futures.Future()
        with self.lock:
            if self.applied < step:
                acc = self.pending.pop(step)
                grads = {k: g.div_(self.workers).mul_(coef) for k, g in acc["grads"].items()}
                self._step(grads, acc["lr"])
                self.applied = step
                self._wake()
            fut.set_result(None)
        return fut

    def skip(self, step: int):
        """s = 0: the step's mean loss or gradient was not finite: drop it, no update."""
        fut = torch.futures.Future()
        with self.lock:
            self.pending.pop(step, None)
            self.applied = max(self.applied, step)
            self._wake()
            fut.set_result(None)
        return fut

    def pull(self, worker: int, step: int):
        """The masters once step `step` may start (the rule above), and the staleness seen."""
        fut = torch.futures.Future()
        with self.lock:
            if self.staleness > 0:
                ready = lambda: min(self.clock) >= step - 1 - self.staleness  # noqa: E731
            else:
                ready = lambda: self.applied >= step - 1  # noqa: E731
            self.waiting.append((ready, fut, lambda: self._snapshot(step)))
            self._wake()
        return fut

    def state(self):
        """Masters and optimizer state ({unit key: {state name: tensor}}), for a checkpoint."""
        fut = torch.futures.Future()
        with self.lock:
            opt = {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v)
                       for n, v in self.optimizer.state.get(p, {}).items()}
                   for k, p in self.masters.items()}
            fut.set_result(({k: p.detach().clone() for k, p in self.masters.items()}, opt))
        return fut

    def traffic(self):
        fut = torch.futures.Future()
        fut.set_result((self.bytes_in, self.bytes_out))
        return fut

    # ------------------------------------------------------------------ internals
    def _step(self, grads: dict, lr: float) -> None:
        for k, p in self.masters.items():
            g = grads.get(k)
            p.grad = torch.zeros_like(p) if g is None else g.to(p.dtype)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p in self.masters.values():
            p.grad = None

    def _norm(self, step: int):
        acc = self.pending[step]
        sq = sum(float(g.float().pow(2).sum()) for g in acc["grads"].values()) / self.workers ** 2
        return torch.cat([torch.tensor([sq, *(acc["loss"] / self.workers).tolist()], dtype=torch.float64),
                          self._stop_field()])

    def stop_step(self, step: int) -> int:
        """The step every worker stops after, decided once, by the first stop request this
        shard sees (pushed with step `step`): s = 0, that step (every worker's push of it is
        answered after all of them arrived, so all read the decision in the same reply); s > 0,
        step + 1 + s: no worker can be running a later step, since a pull of step k waits
        until every worker pushed k - 1 - s and this worker has pushed only `step`. Workers
        read it from shard 0's replies only (one decision, not one per shard), each stopping
        after that step: they all enter the checkpoint's collectives at the same step."""
        return step if self.staleness == 0 else step + 1 + self.staleness

    def _stop_field(self) -> torch.Tensor:
        return torch.tensor([-1 if self.stop_at is None else self.stop_at], dtype=torch.float64)

    def _snapshot(self, step: int):
        lag = max(0, (step - 1) - min(self.clock)) if self.staleness > 0 else 0
        out = {k: p.detach().clone() for k, p in self.masters.items()}
        self.bytes_out += _nbytes(out.values())
        return out, lag

    def _wake(self) -> None:
        """Resolve every parked call whose condition now holds (called with the lock held)."""
        still = []
        for ready, fut, result in self.waiting:
            if ready():
                fut.set_result(result())
            else:
                still.append((ready, fut, result))
        self.waiting = still


def _shard_optimizer(optimizer, units, params, masters):
    """The local optimizer's class, hyperparameters and state, over this shard's masters
    (each unit in the group its whole parameter is in; expert rows take their row of the
    parameter's state)."""
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[])
              for g in optimizer.param_groups]
    for u in units:
        groups[group_of[id(params[u.name])]]["params"].append(masters[u.key])
    from ..offload import same_optimizer   # the class's own keyword arguments, no fused kernel
    shard = same_optimizer(type(optimizer), [g for g in groups if g["params"]], optimizer.defaults,
                           fused=False)
    for u in units:
        st = optimizer.state.get(params[u.name])
        if st:
            shard.state[masters[u.key]] = {k: _state_piece(v, params[u.name], u) for k, v in st.items()}
    return shard


def _state_piece(v, param, unit):
    if isinstance(v, torch.Tensor) and v.dim() and unit.expert >= 0 and v.shape == param.shape:
        return v[unit.expert].detach().float().cpu().clone()
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


# ---------------------------------------------------------------------- rpc entry point
RPC_METHODS = frozenset({"push", "apply", "skip", "pull", "state", "traffic"})


@rpc.functions.async_execution
def rpc_call(shard: str, method: str, *args):
    """What workers call over torch.distributed.rpc: ServerShard.<method>(*args) of the shard
    this process hosts (each returns a future, completed when its consistency rule allows)."""
    if method not in RPC_METHODS:
        raise ValueError(f"parameter server: no method {method!r} (one of {sorted(RPC_METHODS)})")
    return getattr(_HOSTED[shard], method)(*args)
