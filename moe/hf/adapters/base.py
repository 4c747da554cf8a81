"""What a family adapter is: where a model's dense FFNs are, their weights, how to swap them.

Shapes: D model dim, F ffn dim (weights are given as [in, out], the layout of moe.ExpertBank).

An adapter answers four questions for one model family:
  sites(model)          -> the dense FFNs, found structurally (by the attributes they have)
  spec(site, config)    -> d_model, d_ff, activation, biases, dropout of one FFN
  dense_weights(site)   -> its weights transposed into the [in, out] layout (for upcycling)
  install(site, moe, spec) -> put the MoE layer in place, keeping the caller's signature
To support a new family, write one such object (see gpt2.py, ~40 lines) and either pass it to
`moefy(..., adapter=MyAdapter())` or list it in moe/hf/adapters/__init__.py.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ...experts import ACTIVATIONS

# Hugging Face activation name -> moekit activation, for plain and for gated (GLU) FFNs.
_PLAIN_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
              "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu"}
_GATED_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu",
              "gelu_new": "geglu_tanh", "gelu_pytorch_tanh": "geglu_tanh", "gelu_fast": "geglu_tanh"}


def map_activation(hf_name, gated: bool, where: str) -> str:
    """Our activation name for a Hugging Face one, or a clear error naming the config field."""
    table = _GATED_ACT if gated else _PLAIN_ACT
    ours = table.get(hf_name) if isinstance(hf_name, str) else None
    if ours is None or ours not in ACTIVATIONS:
        supported = sorted(k for k, v in table.items() if v in ACTIVATIONS)
        raise ValueError(f"{where}={hf_name!r} has no MoE equivalent for a "
                         f"{'gated' if gated else 'plain'} FFN; supported: {supported}")
    return ours


@dataclass(frozen=True)
class FFNSpec:
    d_model: int
    d_ff: int
    activation: str   # a moe.experts.ACTIVATIONS name
    bias: bool        # the dense FFN has biases (then the experts get them too)
    dropout: float    # dropout the dense module applied to its output (kept after the MoE)


@dataclass(frozen=True)
class DenseWeights:
    w1_DF: torch.Tensor                  # input projection (the gate projection if gated)
    w2_FD: torch.Tensor                  # output projection
    w3_DF: Optional[torch.Tensor] = None  # up projection of gated FFNs: act(x@w1) * (x@w3)
    b1_F: Optional[torch.Tensor] = None
    b2_D: Optional[torch.Tensor] = None
    b3_F: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Site:
    name: str          # qualified module name of `owner`
    owner: nn.Module   # the module whose children get replaced
    stack: str         # "" for decoder-only/encoder-only; "encoder"/"decoder" for T5
    # `every` counts FFNs per stack: FFN i of a stack is swapped iff (i + 1) % every == 0


def linear_in_out(linear: nn.Linear) -> torch.Tensor:
    """nn.Linear stores [out, in]; the experts want [in, out]."""
    return linear.weight.detach().t()


def linear_bias(linear: nn.Linear):
    return None if linear.bias is None else linear.bias.detach()


def dropout_p(module) -> float:
    return float(module.p) if isinstance(module, nn.Dropout) else 0.0


def find_sites(model: nn.Module, attr: str, is_dense, stack_of=lambda name: "") -> list:
    """Modules having a child `attr` for which is_dense(child) holds, in module order."""
    sites = []
    for name, module in model.named_modules():
        child = getattr(module, attr, None)
        if isinstance(child, nn.Module) and is_dense(child):
            sites.append(Site(name, module, stack_of(name)))
    return sites


def has_linears(module: nn.Module, *names) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


class MoEFFN(nn.Module):
    """The swapped-in FFN: forward(hidden_states) -> tensor of the same shape, like the dense one.

    Keeps the dense module's output dropout; dropout *inside* a dense FFN (T5 applies it
    between the two projections) has no place inside the experts and is left out.
    """

    def __init__(self, moe: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.moe = moe
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.moe(hidden_states))
