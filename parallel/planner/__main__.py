"""`python -m parallel.planner`: the command line lives in commands/plan.py (it reads train.py
configs, which sit above parallel/); this program entry hands over to it and is imported by
nothing."""
import runpy

runpy.run_module("commands.plan", run_name="__main__", alter_sys=True)
