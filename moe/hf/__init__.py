"""Hugging Face interop: swap the dense FFNs of a transformers model for MoELayers (moefy,
upcycling), convert a transformers MoE model's own sparse blocks into MoELayers, and write
either back as a checkpoint transformers loads (save_hf) or reload it (load_moefied).

One adapter per family (adapters/<family>.py) says where its FFNs or sparse blocks are and
how their weights map onto a MoELayer; swap.py drives them, convert.py converts sparse
blocks, upcycle.py copies a dense FFN into every expert, export.py and upcycled_export.py
write the result back. The layer (moe/) never imports this package; `moe.moefy` loads it
on first use.
"""
from .adapters import adapter_for, supported_families
from .convert import wrapped_layers
from .export import CONFIG_KEY, save_hf
from .swap import load_moefied, moefy

__all__ = ["moefy", "load_moefied", "save_hf", "adapter_for", "supported_families",
           "wrapped_layers", "CONFIG_KEY"]
