"""Layout planner: which (dp, tp, pp, ep, zero, recompute, micro-batches, schedule) fits a
model on a number of GPUs, and how fast it would run.

    python -m parallel.planner --config configs/gshard_gpt.toml --world 64 --gpu-mem 80

Modules (each states its model in its docstring):
  workload.py    what is trained (model built on meta, batch, token streams, optimizer)
  rank_state.py  what a rank holds: parallelize() run on the meta model in a fake process
                 group, local tensors read back (exact model state and sync payloads)
  memory.py      model state by device, activations, the peak of three step phases
  comm.py        bytes per step by ledger kind (parallel/ledger.py's classification)
  flops.py       training FLOPs per rank from the model's parameters
  schedule.py    pipeline bubble and in-flight micro-batches per schedule
  hardware.py    one GPU's memory, compute and links; data-sheet presets (--hw h100)
  step_time.py   step time from FLOPs and bandwidths
  enumerate.py   every layout validate() accepts
  predict.py     one layout's prediction; report.py ranks and prints them
The library imports nothing above parallel/ (the model arrives as a build function); the
command line (__main__.py) reads train.py's config files.
"""
from .predict import Prediction, StateCache, predict
from .hardware import Hardware, preset
from .workload import Workload

__all__ = ["Hardware", "preset", "Prediction", "StateCache", "Workload", "predict"]
