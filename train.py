"""Train a Mixture-of-Experts model.

    python train.py                                   # small MoE GPT on the embedded corpus (CPU)
    python train.py --config configs/NAME.toml [section.field=value ...]
    torchrun --nproc-per-node 2 train.py parallel.dp=2 [...]

Without --config the built-in defaults run (the same values as configs/default.toml).
Run directories: each run writes to a new runs/<config name>-NNN (run.dir=auto, printed at
start), so the same command can run again; train.resume=true then continues the newest of
them that holds a checkpoint (none: starts from step 0 and says so). An explicit
run.dir=PATH that already holds a run needs train.resume=true or run.overwrite=true.
`python train.py --help` lists every section and field with its default and meaning.
"""
import sys


def _usage() -> str:
    return (__doc__.strip() + "\n\noptions:\n  --config PATH   TOML file (sections as below)\n"
            "  --help          this text\n  --print-config  show the resolved config and exit\n\n")


def parse_args(argv):
    """(config path or None, overrides, flags) from argv; ConfigError on a malformed one."""
    from trainer.config import ConfigError
    path, overrides, flags = None, [], set()
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            flags.add("help")
        elif arg == "--print-config":
            flags.add("print-config")
        elif arg == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config needs a path, e.g. --config configs/default.toml")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; options are --config, --help, --print-config "
                             f"(config fields are given as section.field=value)")
        else:
            overrides.append(arg)
    return path, overrides, flags


def _report_failure(e: Exception) -> int:
    """An unexpected error on this rank: the traceback to stderr, then one line naming the rank
    and the error, which torchrun's summary shows as the root cause. A rank that only lost its
    peers (their process died first) says so in one line and leaves the root cause to the rank
    that failed."""
    import traceback
    from trainer.distributed import env_rank, lost_peer
    from trainer.launcher import record_error_line
    first = (str(e).strip().splitlines() or [""])[0]
    line = f"error on rank {env_rank()}: {type(e).__name__}: {first}"
    if lost_peer(e):
        short = f"rank {env_rank()}: stopping, another rank failed first (here: {first[:120]})"
        print(short, file=sys.stderr, flush=True)
        record_error_line(short, consequence=True)
        return 1
    traceback.print_exc()
    print(line, file=sys.stderr, flush=True)
    record_error_line(line)
    return 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from trainer.config import ConfigError, help_text, load_config, to_toml
    from trainer.distributed import env_rank
    from trainer.stops import Stopped
    try:
        path, overrides, flags = parse_args(argv)
        if "help" in flags:
            print(_usage() + help_text())
            return 0
        cfg = load_config(path, overrides)
        if "print-config" in flags:
            print(to_toml(cfg))
            return 0
        from trainer.run import run
        return run(cfg)
    except ConfigError as e:
        if env_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        from trainer.launcher import record_error_line
        record_error_line(f"error: {e}")  # shown in torchrun's failure summary
        return 2
    except Stopped as e:  # the same on every rank: rank 0 says it, each records it
        if env_rank() == 0:
            print(f"{e.label}: {e}", file=sys.stderr, flush=True)
        from trainer.launcher import record_error_line
        record_error_line(f"{e.label}: {e}")
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - reported as one line (traceback above it), exit 1
        return _report_failure(e)
    except KeyboardInterrupt:
        if env_rank() == 0:
            print("interrupted; the last complete checkpoint is kept (resume with train.resume=true)",
                  file=sys.stderr)
        return 130


if __name__ == "__main__":
    from trainer.launcher import with_traceback_record
    sys.exit(with_traceback_record(main)())
