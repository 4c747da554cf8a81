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
from torch.distributed.tensor import DTensor

from .fusion import run_fused

CLAMPED_SWIGLU = "clamped_swiglu"

def gelu_tanh(h):
    return F.gelu(h, approximate="tanh")


# name -> (base activation, gated). The base activation of clamped_swiglu is None: it is not
# act(h1) * h3 (see Activation).
ACTIVATIONS = {
    "gelu": (F.gelu, False),
    "gelu_tanh": (gelu_tanh, False),
    "relu": (F.relu, False),
    "silu": (F.silu, False),
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
    "geglu_tanh": (gelu_tanh, True),  # T5 v1.1, Gemma
    CLAMPED_SWIGLU: (None, True),
}

# aten backward kernels of the base activations, so a backward needs no autograd re-trace;
# an activation missing here falls back to autograd on a recomputed activation.
_ACT_BACKWARD = {
    F.gelu: lambda g, h: torch.ops.aten.gelu_backward(g, h),
    gelu_tanh: lambda g, h: torch.ops.aten.gelu_backward(g, h, approximate="tanh"),
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


def _gated_forward(name: str, h1, h3, alpha: float, limit: float):
    if name == CLAMPED_SWIGLU:
        return clamped_swiglu(h1, h3, alpha, limit)
    return ACTIVATIONS[name][0](h1) * h3


def _gated_backward(name: str, da, h1, h3, alpha: float, limit: float):
    if name == CLAMPED_SWIGLU:  # clamp's gradient passes where the bound holds (inclusive)
        g = h1.clamp(max=limit)
        sig = torch.sigmoid(g * alpha)
        dg = da * (h3.clamp(min=-limit, max=limit) + 1) * (sig + alpha * g * sig * (1 - sig))
        du = da * g * sig
        return dg * (h1 <= limit), du * ((h3 >= -limit) & (h3 <= limit))
    kernel = _ACT_BACKWARD[ACTIVATIONS[name][0]]
    return kernel(da * h3, h1), da * ACTIVATIONS[name][0](h1)


# The gated activation as two ops (forward; backward giving both gradients): one fused kernel
# each on CUDA, 12 and 20 times an [n, F] half's bytes instead of 20 and 44 as separate ops.
@torch.library.custom_op("moekit::gated_act", mutates_args=())
def gated_act(name: str, h1: torch.Tensor, h3: torch.Tensor, alpha: float,
              limit: float) -> torch.Tensor:
    return run_fused(_gated_forward, h1, name, h1, h3, alpha, limit)


@torch.library.custom_op("moekit::gated_act_backward", mutates_args=())
def gated_act_backward(name: str, da: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor,
                       alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    dh1, dh3 = run_fused(_gated_backward, h1, name, da, h1, h3, alpha, limit)
    return dh1.contiguous(), dh3.contiguous()


@gated_act.register_fake
def _(name, h1, h3, alpha, limit):
    return torch.empty_like(h1)


@gated_act_backward.register_fake
def _(name, da, h1, h3, alpha, limit):
    return torch.empty_like(h1), torch.empty_like(h3)


def _gated_setup(ctx, inputs, output):
    ctx.name, h1, h3, ctx.alpha, ctx.limit = inputs
    ctx.save_for_backward(h1, h3)


def _gated_autograd(ctx, grad):
    h1, h3 = ctx.saved_tensors
    dh1, dh3 = gated_act_backward(ctx.name, grad.contiguous(), h1, h3, ctx.alpha, ctx.limit)
    return None, dh1, dh3, None, None


gated_act.register_autograd(_gated_autograd, setup_context=_gated_setup)


def _same_dtensors(h1, h3) -> bool:
    """Two DTensors laid out alike, shards or replicas (an elementwise op runs on their local
    tensors as is)."""
    return (isinstance(h1, DTensor) and isinstance(h3, DTensor) and h1.placements == h3.placements
            and h1.device_mesh == h3.device_mesh and h1.shape == h3.shape
            and all(p.is_shard() or p.is_replicate() for p in h1.placements)   # no pending sums
            and type(h1.to_local()) is torch.Tensor)


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
        if _same_dtensors(h1, h3):   # tensor parallelism's F shards: the fused op on each
            out = gated_act(self.name, h1.to_local(), h3.to_local(), self.alpha, self.limit)
            return DTensor.from_local(out, h1.device_mesh, h1.placements, run_check=False,
                                      shape=h1.shape, stride=h1.stride())
        if type(h1) is not torch.Tensor or type(h3) is not torch.Tensor:  # other subclasses
            return _gated_forward(self.name, h1, h3, self.alpha, self.limit)
        return gated_act(self.name, h1, h3, self.alpha, self.limit)

    def backward(self, da, h1, h3=None):
        """Gradients of a = self(h1, h3) for the upstream gradient da (no graph kept)."""
        if self.gated:
            return tuple(gated_act_backward(self.name, da.contiguous(), h1, h3, self.alpha,
                                            self.limit))
        kernel = _ACT_BACKWARD.get(self.base)
        if kernel is None:
            leaf = h1.detach().requires_grad_(True)
            with torch.enable_grad():
                return torch.autograd.grad(self(leaf), leaf, da)[0], None
        return kernel(da, h1), None
