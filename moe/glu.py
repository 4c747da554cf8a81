"""GPT-OSS's clamped SwiGLU, the one expert activation that is not act(x@w1) * (x@w3).

Shapes: n rows, F ffn dim.
    g = min(x@w1 + b1, limit)              gate projection, clamped from above only
    u = clamp(x@w3 + b3, -limit, limit)    up projection, clamped both ways
    h = (u + 1) * g * sigmoid(alpha * g)   note the +1 on the up projection
The clamps keep activations bounded for low-precision inference (values from the GPT-OSS
model card/config: alpha 1.702, limit 7.0).
"""
import torch

CLAMPED_SWIGLU = "clamped_swiglu"


def clamped_swiglu(h1_nF: torch.Tensor, h3_nF: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g_nF = h1_nF.clamp(max=limit)
    u_nF = h3_nF.clamp(min=-limit, max=limit)
    return (u_nF + 1) * (g_nF * torch.sigmoid(g_nF * alpha))
