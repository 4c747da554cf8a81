"""Mixed precision: bf16/fp16 autocast over fp32 master weights, fp32 router, fp16 loss scaling.

Parameters, gradients and optimizer state stay fp32 (the "master weights"); each block and the
output head run under autocast, so matmuls run in the low precision. Routers run with
autocast off: their logits, softmax and top-k stay fp32 (small logit differences decide
which expert a token goes to). fp16's narrow range needs loss scaling: DynamicLossScaler
multiplies the loss, unscales gradients, skips the step when any rank saw inf/nan and halves
the scale, and grows it again after `growth_interval` clean steps.
"""
import functools

import torch
import torch.distributed as dist

from moe import Router

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _device_type(module) -> str:
    p = next(module.parameters(), None)
    return "cuda" if p is not None and p.device.type == "cuda" else "cpu"


def _wrap(module, enabled: bool, dtype=None) -> None:
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(_device_type(module), dtype=dtype, enabled=enabled):
            return inner(*args, **kwargs)

    module.forward = forward  # instance attribute: parameter names are unchanged


def apply_precision(model, precision: str) -> None:
    """Autocast every block and the lm_head to bf16/fp16; keep routers in fp32."""
    if precision == "fp32":
        return
    if precision not in DTYPES:
        raise ValueError(f"parallel.precision={precision!r}; use fp32, bf16 or fp16")
    for m in model.modules():
        if isinstance(m, Router):
            _wrap(m, enabled=False)
    targets = list(getattr(model, "blocks", [])) + [getattr(model, "lm_head", None)]
    for m in targets:
        if m is not None:
            _wrap(m, enabled=True, dtype=DTYPES[precision])


class DynamicLossScaler:
    """fp16 loss scaling over whatever gradients a rank holds (full, slices, shards):

        scaler.scale(loss).backward()
        overflow = scaler.unscale_(par.grads())    # every rank gets the same answer
        ... clip, then optimizer.step() unless overflow ...
        scaler.update(overflow)

    or `stepped = scaler.step(par.grads(), optimizer)` for both. An overflow halves the scale
    (not below min_scale) and the step is skipped; `growth_interval` clean steps in a row
    double it. `skipped` counts skipped steps.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, min_scale: float = 1.0):
        self.scale_value, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps, self.skipped = 0, 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, grads: list) -> bool:
        """Divide the gradients by the scale; True if any rank found inf/nan."""
        found = torch.zeros((), device=grads[0].device if grads else "cpu")
        for g in grads:
            g.div_(self.scale_value)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped += 1
            self.good_steps = 0
            self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale_value *= self.growth_factor

    def step(self, grads: list, optimizer) -> bool:
        """Unscale, step the optimizer if every gradient is finite, update the scale;
        returns whether it stepped."""
        overflow = self.unscale_(grads)
        if not overflow:
            optimizer.step()
        self.update(overflow)
        return not overflow

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.scale_value, self.good_steps, self.skipped = sd["scale"], sd["good_steps"], sd["skipped"]
