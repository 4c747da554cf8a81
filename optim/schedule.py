"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""
import math


class WarmupCosine:
    """lr(step): linear from lr/warmup to lr over `warmup` steps, then cosine down to
    lr*min_ratio at `total`. `step()` is called after each optimizer step."""

    def __init__(self, optimizer, lr: float, warmup: int, total: int, min_ratio: float):
        self.optimizer, self.lr, self.warmup, self.total = optimizer, lr, warmup, total
        self.min_ratio, self.last_step = min_ratio, 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        floor = self.lr * self.min_ratio
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.last_step)

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> float:
        return self.lr_at(self.last_step)

    def state_dict(self) -> dict:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self._apply()
