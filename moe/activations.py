"""Expert activations: the table of names, and one object per bank that runs an activation
forward and backward for every expert path (loop, grouped_mm, plain ops).

Shapes: n rows, F ffn dim. h1 = x @ w1 (+ b1), h3 = x @ w3 (+ b3) for gated activations.
Ungated: a = act(h1). Gated: a = act(h1) * h3, except GPT-OSS's clamped SwiGLU:
    g = min(h1, limit)                     gate projection, clamped from above only
    u = clamp(h3, -limit, limit)           up projection, clamped both ways
    a = (u + 1) * g * sigmoid(alpha * g)   note the +1 on the up projection
(alpha 1.702, limit 7.0 from the GPT-OSS model card/config; the clamps keep activations
bounded for low-precision inference). It is the one activation that is not act(h1) * h3, and
this file is the only place that knows it.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CLAMPED_SWIGLU = "clamped_swiglu"

# name -> (base activation, gated). The base activation of clamped_swiglu is None: it is not
# act(h1) * h3 (see Activation).
ACTIVATIONS = {
    "gelu": (F.gelu, False),
    "gelu_tanh": (lambda h: F.gelu(h, approximate="tanh"), False),
    "relu": (F.relu, False),
    "silu": (F.silu, False),
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
    "geglu_tanh": (lambda h: F.gelu(h, approximate="tanh"), True),  # T5 v1.1, Gemma
    CLAMPED_SWIGLU: (None, True),
}

# aten backward kernels of the base activations, so a backward needs no autograd re-trace;
# an activation missing here falls back to autograd on a recomputed activation.
_ACT_BACKWARD = {
    F.gelu: lambda g, h: torch.ops.aten.gelu_backward(g, h),
    F.silu: lambda g, h: torch.ops.aten.silu_backward(g, h),
    F.relu: lambda g, h: torch.ops.aten.threshold_backward(g, h, 0),
}


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; use one of {sorted(ACTIVATIONS)}")


def clamped_swiglu(h1_nF: torch.Tensor, h3_nF: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g_nF = h1_nF.clamp(max=limit)
    u_nF = h3_nF.clamp(min=-limit, max=limit)
    return (u_nF + 1) * (g_nF * torch.sigmoid(g_nF * alpha))


@dataclass(frozen=True)
class Activation:
    """`act(h1, h3=None)` -> a; `act.backward(da, h1, h3=None)` -> (dh1, dh3 or None).
    recompute: the expert paths keep h1 (h3) only and compute a again in backward
    (parallel.recompute_modules=moe_act), instead of keeping it."""
    name: str
    alpha: float = 1.702   # clamped_swiglu only
    limit: float = 7.0     # clamped_swiglu only
    recompute: bool = False

    def __post_init__(self):
        check_activation(self.name)
        if not self.limit > 0:
            raise ValueError(f"swiglu_limit={self.limit!r} must be > 0 (GPT-OSS uses 7.0)")

    @property
    def gated(self) -> bool:
        return ACTIVATIONS[self.name][1]

    @property
    def base(self):
        return ACTIVATIONS[self.name][0]

    def __call__(self, h1, h3=None):
        if not self.gated:
            return self.base(h1)
        if self.base is None:
            return clamped_swiglu(h1, h3, self.alpha, self.limit)
        return self.base(h1) * h3

    def backward(self, da, h1, h3=None):
        """Gradients of a = self(h1, h3) for the upstream gradient da (no graph kept)."""
        kernel = _ACT_BACKWARD.get(self.base)
        if kernel is None:
            leaves = [t.detach().requires_grad_(True) for t in (h1, h3) if t is not None]
            with torch.enable_grad():
                grads = torch.autograd.grad(self(*leaves), leaves, da)
            return grads[0], (grads[1] if len(grads) > 1 else None)
        if not self.gated:
            return kernel(da, h1), None
        return kernel(da * h3, h1), da * self.base(h1)
