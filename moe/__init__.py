"""The Mixture-of-Experts layer: router, dispatcher, experts (see docs/design.md).

The layer's pieces live flat in this package (config, router, scoring, routing, capacity,
losses, dispatcher, ep_dispatcher, all_to_all, experts, grouped_mm, activations, placement,
stats, layer, aux). Two subpackages hold the other ways people use the toolkit, and the layer
never imports them: moe.hf (Hugging Face interop: moefy, convert, save_hf) and moe.profiling
(load-balance profiles, heatmaps, traces). `from moe import moefy` still works: it loads
moe.hf on first use, so `from moe import MoELayer` does not import transformers adapters.
"""
from .config import RoutingConfig
from .experts import ACTIVATIONS, DenseFFN, ExpertBank
from .layer import MoELayer
from .router import Router
from .stats import RoutingStats

__all__ = ["MoELayer", "Router", "RoutingConfig", "ExpertBank", "DenseFFN", "RoutingStats",
           "ACTIVATIONS", "moefy"]


def __getattr__(name):
    if name == "moefy":  # the HF interop entry point, loaded on first use
        from .hf import moefy
        return moefy
    raise AttributeError(f"module 'moe' has no attribute {name!r}")
