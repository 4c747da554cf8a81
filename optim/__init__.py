"""Optimizers and what steps them: AdamW/Adafactor with weight-decay groups (build.py),
Adafactor itself (adafactor.py, also on sharded DTensors), the warmup + cosine schedule
(schedule.py) and the fp16 loss scaler (loss_scale.py). Below parallel/ and trainer/: it knows
no layout; parallel/ adapts an optimizer to a layout (ZeRO slices, host masters)."""
from .adafactor import Adafactor
from .build import OPTIMIZERS, build_optimizer, is_no_decay, param_groups
from .loss_scale import DynamicLossScaler
from .schedule import WarmupCosine

__all__ = ["Adafactor", "OPTIMIZERS", "build_optimizer", "is_no_decay", "param_groups",
           "DynamicLossScaler", "WarmupCosine"]
