"""`python -m trainer.study`: the command line lives in commands/study.py (commands sit above
trainer/); this program entry hands over to it, so importing trainer.study loads nothing."""

if __name__ == "__main__":
    import runpy
    runpy.run_module("commands.study", run_name="__main__", alter_sys=True)
