"""Command lines on top of the library: the planner (plan.py, `python -m parallel.planner`),
the load profiler (profile.py, `python -m trainer.profile`) and the scaling study (study.py,
`python -m trainer.study`). Nothing below imports them; the `python -m` paths users know are
thin program entries that hand over to these modules."""
