"""The values each parallel.* choice field accepts (ParallelPlan's tp_mode, precision, fp8_recipe,
recompute, recompute_modules, cp_mode, offload, param_dtype, a2a_overlap); parallel/plan.py
imports them for its users, the rules here for their checks."""
from ..recompute_parts import RECOMPUTE_PARTS

TP_MODES = ("1d", "2d", "2.5d")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")   # parallel/fp8.py (torchao's recipe names)
RECOMPUTE = ("none", "full", "selective")
# parallel.recompute=selective's parts (parallel/recompute_parts.py, their one list)
RECOMPUTE_MODULES = tuple(RECOMPUTE_PARTS)
CP_MODES = ("ring", "ulysses")
OFFLOADS = ("none", "optimizer", "params")
PARAM_DTYPES = ("fp32", "bf16")
A2A_OVERLAPS = ("none", "1f1b")
