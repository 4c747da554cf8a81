"""The ZeRO paper's Table 1 against the planner: per-device model-state memory (GB = 1e9 bytes)
of dense 7.5B, 128B and 1T GPTs under ZeRO-1/2/3 with bf16 parameters and K = 12, for
Nd = 1 .. 1024 (trainer/zero_table.py says what is compared).

    python bench/zero_table.py
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.zero_table import DEGREES, MODELS, paper_bytes, planner, planner_bytes  # noqa: E402


def main() -> None:
    start = time.time()
    print(f"{'model':>6} {'Nd':>5} | {'ZeRO-1 moekit':>13} {'paper':>9} | {'ZeRO-2 moekit':>13} "
          f"{'paper':>9} | {'ZeRO-3 moekit':>13} {'paper':>9}")
    worst = 0.0
    for name, (config, psi) in MODELS.items():
        setup = planner(config)
        for nd in DEGREES:
            cells = []
            for zero in (1, 2, 3):
                got, want = planner_bytes(setup, nd, zero) / 1e9, paper_bytes(psi, nd, zero) / 1e9
                worst = max(worst, abs(got - want) / want)
                cells.append(f"{got:13.2f} {want:9.2f}")
            print(f"{name:>6} {nd:>5} | " + " | ".join(cells), flush=True)
    print(f"worst relative difference {worst:.1e}; {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
