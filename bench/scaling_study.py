"""Benchmark: the scaling study on the default config and the embedded corpus, sized to take
at most ~15 minutes on the project's 2-core CPU (README "What experts buy").

  python bench/scaling_study.py [--steps 200] [--experts 1,2,4,8,16,32] [--out runs/study-default]

It is `python -m trainer.study scaling` with these settings; extra arguments are passed on
(e.g. --top-k 1, model.arch=switch model.vocab_size=384, --nproc 2 parallel.ep=2). A rerun
skips the finished points.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from commands.study import main  # noqa: E402

DEFAULTS = ["--steps", "200", "--experts", "1,2,4,8,16,32", "--out", "runs/study-default"]

if __name__ == "__main__":
    given = sys.argv[1:]
    flags = {a for a in given if a.startswith("--")}
    extra = [x for i in range(0, len(DEFAULTS), 2) for x in DEFAULTS[i:i + 2] if DEFAULTS[i] not in flags]
    sys.exit(main(["scaling", *extra, *given]))
