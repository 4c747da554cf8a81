"""The optimizer (AdamW, or Adafactor as the Switch Transformer trained with) with
weight-decay groups.

Adafactor (optim/adafactor.py: torch.optim.Adafactor's update, also on sharded DTensors)
keeps factored second moments for matrices: a row and a column statistic instead of a full
[rows, cols] moment, and no first moment, so its state is a small fraction of AdamW's
2 x params. Its step size is relative to each parameter's RMS, capped by the scheduled lr. It
needs the parameters' matrix shapes: ZeRO-1/2's flat slices would silently turn it into an
unfactored optimizer, so those are refused with it (trainer/config.py); ZeRO-3's FSDP2 shards
keep the shapes and work, offloaded or not.

Decay applies to matrices only. Norm scales, biases (1-D) and router weights are not decayed:
shrinking a router towards uniform logits fights the load-balancing it is trained for.
"""
import torch

from .adafactor import Adafactor


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    return param.ndim < 2 or "router" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list:
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # named_parameters() lists a tied weight once
        if p.requires_grad:
            (no_decay if is_no_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


OPTIMIZERS = ("adamw", "adafactor")


def build_optimizer(model: torch.nn.Module, train_cfg) -> torch.optim.Optimizer:
    groups = param_groups(model, train_cfg.weight_decay)
    if train_cfg.optimizer == "adafactor":
        return Adafactor(groups, lr=train_cfg.lr, relative_step=train_cfg.adafactor_relative_step)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
                             eps=train_cfg.eps)
