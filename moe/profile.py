"""Former home of the load profiler, as an earlier README documented it:
`moe.profile.profile_model(model, batches, out_dir, tokenizer=None)` and
`python -m moe.profile --config ... --out ...`. The library lives in moe/profiling/, the
command line in commands/profile.py (today's `python -m trainer.profile`); this alias keeps
both old paths working. Run as a program it hands over to the command, so importing it
loads no command code."""
from .profiling import profile_model

__all__ = ["profile_model"]

if __name__ == "__main__":
    import runpy
    runpy.run_module("commands.profile", run_name="__main__", alter_sys=True)
