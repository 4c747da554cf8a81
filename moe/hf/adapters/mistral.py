"""Mistral: `model.layers[i].mlp` (MistralMLP), a gated SiLU MLP; see gated_mlp.py."""
from .gated_mlp import GatedMLPAdapter

ADAPTER = GatedMLPAdapter("mistral", ("mistral",))
