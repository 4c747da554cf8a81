"""ParallelPlan.validate's rules, one module per concept: degrees.py (degrees, choices, dp),
tensor.py, context.py, experts.py, pipeline.py, data_parallel.py (ZeRO family, parameter
server), recompute.py, model.py (model and batch sizes, fp8); choices.py holds the accepted
values. The rules never import parallel/plan.py (it imports them); `_err` is their error."""


def _err(msg: str) -> ValueError:
    return ValueError(msg)
