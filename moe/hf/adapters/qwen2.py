"""Qwen2: `model.layers[i].mlp` (Qwen2MLP), a gated SiLU MLP; see gated_mlp.py."""
from .gated_mlp import GatedMLPAdapter

ADAPTER = GatedMLPAdapter("qwen2", ("qwen2",))
