"""Llama: `model.layers[i].mlp` (LlamaMLP), a gated SiLU MLP; see gated_mlp.py."""
from .gated_mlp import GatedMLPAdapter

ADAPTER = GatedMLPAdapter("llama", ("llama",))
