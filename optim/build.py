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


OPTIMIZERS = ("adamw", "adafactor", "muon")


def muon_groups(model: torch.nn.Module, weight_decay: float) -> list:
    """Muon's hidden matrices (decayed), then AdamW's decay / no-decay groups of the rest."""
    from .muon import split_params
    muon, rest = split_params(model)
    decay = [p for n, p in rest if not is_no_decay(n, p)]
    no_decay = [p for n, p in rest if is_no_decay(n, p)]
    return [{"params": muon, "weight_decay": weight_decay, "muon": True, "name": "muon"},
            {"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def build_optimizer(model: torch.nn.Module, train_cfg) -> torch.optim.Optimizer:
    if train_cfg.optimizer == "muon":
        from .muon import MuonAdamW
        t = train_cfg
        return MuonAdamW(muon_groups(model, t.weight_decay), t.lr, betas=(t.beta1, t.beta2),
                         eps=t.eps, momentum=t.muon_momentum, nesterov=t.muon_nesterov,
                         ns_steps=t.muon_ns_steps, adjust_lr=t.muon_adjust_lr,
                         ns_dtype=t.muon_ns_dtype)
    groups = param_groups(model, train_cfg.weight_decay)
    if train_cfg.optimizer == "adafactor":
        return Adafactor(groups, lr=train_cfg.lr, relative_step=train_cfg.adafactor_relative_step)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2),
                             eps=train_cfg.eps, **adamw_impl(train_cfg.optimizer_impl, model,
                                                               train_cfg.step_checks == "device"))


def adamw_impl(impl: str, model: torch.nn.Module, device_checks: bool = False) -> dict:
    """torch.optim.AdamW's implementation keywords for train.optimizer_impl. auto: the fused
    kernel (one launch per parameter group and dtype) when every parameter is on CUDA or
    train.step_checks=device (its skip is the fused kernel's found_inf), else torch's default
    (foreach on CUDA, a per-parameter loop on CPU, where fused gains little)."""
    if impl == "auto":
        on_cuda = all(p.device.type == "cuda" for p in model.parameters())
        return {"fused": True} if on_cuda or device_checks else {}
    return {"fused": impl == "fused", "foreach": impl == "foreach"}
