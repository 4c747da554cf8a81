"""`python -m trainer.generate`: the command line lives in commands/generate.py (commands sit above
trainer/); this program entry hands over to it, so importing trainer.generate loads nothing."""

if __name__ == "__main__":
    import runpy
    runpy.run_module("commands.generate", run_name="__main__", alter_sys=True)
