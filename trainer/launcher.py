"""Telling torchrun why this process stopped, so its failure summary shows the cause.

torchrun (torch.distributed.elastic) gives every worker an error file in the environment
variable TORCHELASTIC_ERROR_FILE and, when a worker exits non-zero, prints that file's
`message` in its "Root Cause" summary. A user mistake (ConfigError) is recorded as its one
line instead of a traceback; unexpected exceptions go through torch's own `record`.
"""
import json
import os
import time


def record_error_line(line: str, consequence: bool = False, began_before: bool = False) -> None:
    """Write `line` as this worker's error for torchrun's summary (a no-op outside torchrun).
    torchrun names the failure with the smallest timestamp (whole seconds) the root cause; a
    `consequence` (this rank only lost a peer that failed first) is dated one second later,
    so it never wins a tie against the rank that caused it; `began_before` (a hang, seen
    run.hang_timeout_s after the silence began) one second earlier, so it wins the tie against
    the silent rank this one then kills (torchrun dates that kill when it sees it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = int(time.time()) + (1 if consequence else 0) - (1 if began_before else 0)
    data = {"message": {"message": line,
                        "extraInfo": {"py_callstack": line, "timestamp": str(stamp)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then lacks the line; stderr still has it


def with_traceback_record(main):
    """`main` wrapped by torch's elastic `record` (tracebacks of unexpected errors reach the
    torchrun summary); the plain function where that module is unavailable."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:
        return main
    return record(main)
