"""`python -m trainer.evaluate`: the command line lives in commands/evaluate.py (commands sit above
trainer/); this program entry hands over to it, so importing trainer.evaluate loads nothing."""

if __name__ == "__main__":
    import runpy
    runpy.run_module("commands.evaluate", run_name="__main__", alter_sys=True)
