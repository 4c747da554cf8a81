"""`python -m trainer.profile`: the command line lives in commands/profile.py (commands sit above
trainer/); this program entry hands over to it, so importing trainer.profile loads nothing."""

if __name__ == "__main__":
    import runpy
    runpy.run_module("commands.profile", run_name="__main__", alter_sys=True)
