"""Adafactor (Shazeer & Stern 2018; the Switch Transformer's optimizer) that also steps
sharded parameters: plain tensors, tensor-parallel DTensors and ZeRO-3 (FSDP2) shards.

The update is torch.optim.Adafactor's (same hyperparameters, same state names and shapes, so
checkpoints move between the two); torch's own step fails on DTensor shards because its
row/column norms over a sharded dim become partial tensors that its in-place ops cannot take.
Here every reduction is a local sum over the shard plus an all-reduce over exactly the mesh
dims that split the reduced dim, divided by the global size:

  rows r, cols c of the last two dims (leading dims are batch, e.g. experts)
  row_var[.., r, 1] <- lerp(row_var, mean_c g^2, 1 - beta2_t)     beta2_t = 1 - t^beta2_decay
  col_var[.., 1, c] <- lerp(col_var, mean_r g^2, 1 - beta2_t)
  V = row_var @ col_var / max(mean_r row_var, eps1)               (vectors: a full variance)
  U = g / sqrt(max(V, eps1^2));  alpha = max(eps2, RMS(param)) * min(lr, 1/sqrt(t))
                                 (relative_step=False: alpha = lr, a set step size)
  param <- param * (1 - lr * weight_decay) - alpha * U / max(1, RMS(U) / d)

State tensors are DTensors when the parameter is: row_var/col_var keep the parameter's
placements except a shard of the reduced dim (size 1), which becomes Replicate. The
reductions are small (a [1, C] or [R, 1] vector and two scalars per sharded parameter); the
communication ledger books them by their group (dp_grad_reduce on data groups).
"""
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _shard_dims(p) -> dict:
    """{tensor dim: [process groups of the mesh dims that split it]} of a DTensor (else {})."""
    if not isinstance(p, DTensor):
        return {}
    out = {}
    for i, pl in enumerate(p.placements):
        dim = getattr(pl, "dim", None)  # Shard and _StridedShard have .dim
        if dim is not None and p.device_mesh.size(i) > 1:
            out.setdefault(dim % p.dim(), []).append(p.device_mesh.get_group(i))
    return out


class Adafactor(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
                 weight_decay=0.0, *, maximize=False, relative_step=True):
        if not lr >= 0 or not beta2_decay <= 0 or not d >= 1 or not weight_decay >= 0:
            raise ValueError(f"Adafactor: need lr >= 0, beta2_decay <= 0, d >= 1, weight_decay "
                             f">= 0 (got {lr}, {beta2_decay}, {d}, {weight_decay})")
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                                      weight_decay=weight_decay, maximize=maximize,
                                      relative_step=relative_step))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _state(self, p):
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            if p.dim() > 1:
                st["row_var"] = _zeros_reduced(p, -1)
                st["col_var"] = _zeros_reduced(p, -2)
            else:
                st["variance"] = torch.zeros_like(p)
        return st

    def _update(self, p, group) -> None:
        st = self._state(p)
        shards = _shard_dims(p)
        x, g = _local(p), _local(p.grad)
        if group["maximize"]:
            g = -g
        eps1, eps2 = group["eps"]
        eps1 = torch.finfo(x.dtype).eps if eps1 is None else eps1
        st["step"] += 1
        t = st["step"].item()
        lr = float(group["lr"])
        if group["relative_step"]:
            alpha = _rms(x, p, shards).clamp(min=eps2) * min(lr, 1 / math.sqrt(t))
        else:
            alpha = lr
        if group["weight_decay"]:
            x.mul_(1 - lr * group["weight_decay"])
        one_minus_beta2 = t ** group["beta2_decay"]
        if p.dim() > 1:
            row_var, col_var = _local(st["row_var"]), _local(st["col_var"])
            g2 = g * g
            row_var.lerp_(_mean(g2, -1, p, shards), one_minus_beta2)
            col_var.lerp_(_mean(g2, -2, p, shards), one_minus_beta2)
            var = row_var @ col_var
            var.div_(_mean(row_var, -2, p, shards).clamp_(min=eps1))
        else:
            variance = _local(st["variance"])
            variance.lerp_(g * g, one_minus_beta2)
            var = variance.clone()
        update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
        denom = (_rms(update, p, shards) / group["d"]).clamp(min=1.0)
        # tensors on the device, not floats: no host sync per parameter (the step count is
        # a host tensor, so t above costs none either)
        x.sub_(update.mul_((alpha / denom).to(update.dtype)))


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _all_reduce(t, groups) -> torch.Tensor:
    for grp in groups:
        dist.all_reduce(t, group=grp)
    return t


def _mean(t, dim: int, p, shards: dict) -> torch.Tensor:
    """Mean over `dim` of a local tensor laid out like p, over the whole (unsharded) dim."""
    d = dim % p.dim()
    s = t.sum(dim=dim, keepdim=True)
    return _all_reduce(s, shards.get(d, [])).div_(p.shape[d])


def _rms(t, p, shards: dict) -> torch.Tensor:
    """Root mean square (fp32 0-dim tensor on t's device) of the whole (unsharded) tensor
    whose local piece is t."""
    sq = t.float().pow(2).sum().reshape(1)
    groups = [grp for gs in shards.values() for grp in gs]
    return (_all_reduce(sq, groups)[0] / p.numel()).sqrt()


def _zeros_reduced(p, dim: int):
    """Zeros shaped like p with `dim` reduced to 1 (a DTensor if p is one; a shard of the
    reduced dim becomes Replicate)."""
    d = dim % p.dim()
    if not isinstance(p, DTensor):
        shape = list(p.shape)
        shape[d] = 1
        return torch.zeros(shape, dtype=p.dtype, device=p.device)
    loc = list(p.to_local().shape)
    loc[d] = 1
    placements = [Replicate() if getattr(pl, "dim", None) is not None and pl.dim % p.dim() == d else pl
                  for pl in p.placements]
    shape = list(p.shape)
    shape[d] = 1
    return DTensor.from_local(torch.zeros(loc, dtype=p.dtype, device=p.to_local().device),
                              p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
