"""Mixed precision: bf16/fp16 autocast over fp32 master weights, fp32 router.

Parameters, gradients and optimizer state stay fp32 (the "master weights"); each block and the
output head run under autocast, so matmuls run in the low precision. Routers run with
autocast off: their logits, softmax and top-k stay fp32 (small logit differences decide
which expert a token goes to). fp16's narrow range also needs loss scaling, which the
training step applies (optim/loss_scale.py DynamicLossScaler).
"""
import functools

import torch

from models.blocks import blocks
from moe import Router

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: bf16 + FP8 GEMMs


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
    """Autocast every block (of every stack: models.blocks), the MTP depths' projections and
    the lm_head to bf16/fp16;
    keep routers in fp32."""
    if precision == "fp32":
        return
    if precision not in DTYPES:
        raise ValueError(f"parallel.precision={precision!r}; use fp32, bf16, fp16 or fp8")
    for m in model.modules():
        if isinstance(m, Router):
            _wrap(m, enabled=False)
    mtp_projections = [d.eh_proj for d in getattr(model, "mtp", None) or []]  # models/mtp.py
    targets = blocks(model) + mtp_projections + [getattr(model, "lm_head", None)]
    for m in targets:
        if m is not None:
            _wrap(m, enabled=True, dtype=DTYPES[precision])
