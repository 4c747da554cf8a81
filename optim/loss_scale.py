"""fp16 dynamic loss scaling: multiply the loss, unscale the gradients, skip a step whose
gradients overflowed on any rank (halving the scale), grow the scale after a run of clean steps."""
import torch
import torch.distributed as dist


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
