"""Old path of parallel/pipeline/paired_steps.py (the schedules' forward/backward pairs), kept for compatibility."""
from .paired_steps import *  # noqa: F401,F403
from .paired_steps import (__all__, overlap_schedule, overlapped_order, paired_counts,  # noqa: F401
                           pairs_of, torch_order)
