"""Mixture-of-Experts layer: router, dispatcher, experts (see ARCHITECTURE.md)."""
from .experts import ACTIVATIONS, DenseFFN, ExpertBank
from .layer import MoELayer
from .router import Router
from .stats import RoutingStats
from .swap import moefy

__all__ = ["MoELayer", "Router", "ExpertBank", "DenseFFN", "RoutingStats", "ACTIVATIONS", "moefy"]
