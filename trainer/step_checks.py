"""train.step_checks=device: the step's non-finite guard decided on the device and read on the
host once per log interval, so the host queues step n+1 while the device still runs step n.

The host mode (execution.Plain, steps.Trainer) reads each step's loss and gradient norm to
decide whether to take the optimizer step; on a GPU that read waits for the whole step. Here
each step's verdict (a non-finite loss or gradient norm on any rank) stays a device scalar:
  - the optimizer step is fused AdamW's with found_inf = the verdict: a skipped step leaves the
    weights, moments and step counts as they were (the kernel skips, the count is undone);
  - its learning rate is a device scalar, the schedule's rate at (steps taken): the schedule's
    position at the last read plus the steps since, less the skips among them, which only the
    device knows: a table of the possible rates indexed by the device's count of skips. Every
    step runs at the rate the host mode would give it;
  - the router bias moves only for a step taken (Router.update_selection_bias(applied=...)).
The Trainer holds each step's record beside its device values [loss, aux, norm, skipped]; `read`
fetches all of them in one copy (one wait), advances the schedule by the steps taken, and
returns them in step order. A SIGTERM is agreed on every step between the hosts (gloo, no
device wait) and makes that step a read.
"""
import time

import torch
import torch.distributed as dist

from .config import step_checks_blocker
from .distributed import any_rank

__all__ = ["DeviceChecks", "resolve_step_checks"]


def resolve_step_checks(cfg, plan, optimizer, device: torch.device) -> str:
    """'device' or 'host' for train.step_checks (auto: device on CUDA where it can run)."""
    want = cfg.train.step_checks
    if want == "host":
        return "host"
    fused = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and \
        bool(optimizer.defaults.get("fused"))
    can = fused and not step_checks_blocker(cfg, plan)
    if want == "device":
        if not can:  # the config check refused every other case; the optimizer was built unfused
            from .config import ConfigError
            raise ConfigError("train.step_checks='device' needs torch's fused AdamW; set "
                              "train.optimizer_impl='fused' or train.step_checks='host'")
        return "device"
    return "device" if can and device.type == "cuda" else "host"


class DeviceChecks:
    """The held steps since the last read and the device's count of skips among them."""

    def __init__(self, ctx, device: torch.device, host_group=None):
        self.ctx, self.device = ctx, device
        self.host_group = host_group  # gloo group for stop_agreed (None: gloo is the default group)
        self.held = []  # (step, record, values [loss, aux, norm, skipped, *extras] on the
                        # device, the extras' record keys)
        self.skips = torch.zeros((), dtype=torch.long, device=device)  # among self.held
        self.since = time.perf_counter()  # the first held step's start: they share the time since

    def start(self, t0: float) -> None:
        """A step begins at t0: the first after a read starts the held steps' time."""
        if not self.held:
            self.since = t0

    def verdict(self, total_loss: torch.Tensor, norm) -> torch.Tensor:
        """0-dim float on the device: 1 where the loss or the norm is non-finite on any rank."""
        bad = ~torch.isfinite(total_loss.detach()).all()
        if norm is not None:
            bad = bad | ~torch.isfinite(norm)
        bad = bad.float().reshape(1)
        if self.ctx.distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # queued on the device's stream
        return bad[0]

    def optimizer_step(self, optimizer, sched, skipped: torch.Tensor) -> None:
        """The fused AdamW step with found_inf = skipped, at the rate the host mode would use."""
        lr = self._rate(sched)
        groups = optimizer.param_groups
        rates = [g["lr"] for g in groups]  # the schedule's floats stay in the state dict
        for g in groups:
            g["lr"] = lr
        optimizer.found_inf = skipped
        try:
            optimizer.step()  # DTensor parameters: parallel.dtensors.step_with_plain_replicated
        finally:
            del optimizer.found_inf
            for g, r in zip(groups, rates):
                g["lr"] = r

    def _rate(self, sched) -> torch.Tensor:
        j = len(self.held)  # steps since the last read; the device knows how many were skipped
        # CUDA's fused kernel reads an fp32 rate (as it rounds a host float); the CPU kernel a double
        dtype = torch.float32 if self.device.type == "cuda" else torch.float64
        table = torch.tensor([sched.lr_at(sched.last_step + j - s) for s in range(j + 1)], dtype=dtype)
        if self.device.type == "cuda":
            table = table.pin_memory()
        # index_select: indexing with a tensor (table[skips]) would read it on the host
        return table.to(self.device, non_blocking=True).index_select(0, self.skips.reshape(1)).reshape(())

    def hold(self, n: int, rec: dict, loss, aux, norm, skipped: torch.Tensor, extras=None) -> None:
        """Keep step n's values for the next read; extras: {record key: device scalar} read
        in the same copy into the record (the MTP depths' losses)."""
        extras = extras or {}
        nan = torch.full((), float("nan"), device=self.device)
        values = torch.stack([loss.detach().float().reshape(()), aux.detach().float().reshape(()),
                              nan if norm is None else norm.detach().float().reshape(()), skipped,
                              *(v.detach().float().reshape(()) for v in extras.values())])
        self.held.append((n, rec, values, list(extras)))
        self.skips += skipped.long()

    def stop_agreed(self, requested: bool) -> bool:
        """Whether any rank has seen a SIGTERM, agreed every step between the hosts (a CPU
        tensor over a gloo group: nothing waits for the device), so that every rank reads
        its held steps and stops at the same step, however long log.every's steps take."""
        return any_rank(self.ctx, [requested], self.host_group)[0]

    def read(self, sched) -> list:
        """[(step, record, loss, aux, norm, skipped, lr, seconds)] in step order, after one
        read of the device; the schedule advances by the steps taken."""
        values = torch.stack([v for _, _, v, _ in self.held]).tolist() if self.held else []
        now = time.perf_counter()
        seconds = (now - self.since) / max(1, len(self.held))
        out = []
        for (n, rec, _, keys), (loss, aux, norm, skipped, *extras) in zip(self.held, values):
            rec.update(zip(keys, extras))
            for k, v in rec.items():  # figures left on the device (interleave.Baton.take)
                if callable(v):
                    rec[k] = v()
            out.append((n, rec, loss, aux, norm, bool(skipped), sched.get_last_lr(), seconds))
            if not skipped:
                sched.step()
        self.held, self.since = [], now
        self.skips.zero_()
        return out
