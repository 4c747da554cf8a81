"""Load-balance profiling of any model holding MoELayers: per-expert load, imbalance, dead
experts, rows per expert-parallel rank (load.py: profile_model -> load.json, load.png,
TensorBoard), the heatmap (heatmap.py) and a timed trace of the MoE phases (trace.py).
CLI: `python -m trainer.profile` (it builds the model from a train.py config)."""
from .heatmap import heatmap_figure, save_heatmap
from .load import collect_load, profile_model
from .trace import print_breakdown, trace_step

__all__ = ["profile_model", "collect_load", "heatmap_figure", "save_heatmap", "trace_step",
           "print_breakdown"]
