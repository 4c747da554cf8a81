"""Suite-wide: a run over the whole tests/ folder must collect the multi-process proofs, and
the longest tests start first.

pytest skips folders named `dist` by default (norecursedirs), which once kept tests/dist out
of CI without a word. pyproject.toml overrides that; this hook makes any regression loud.

Tests marked `long` (30 s or more alone) run first: under the README's two pytest workers
(pytest-xdist, work stealing) a long test left for the end would run alone on one worker
while the other sits idle.
"""
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection: count what was collected
def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: long first
    targets = [Path(a.split("::")[0]).resolve() for a in config.args] or [TESTS]
    if TESTS not in targets:
        return  # a narrower run (tests/unit, one file) is the user's choice
    dist_items = [i for i in items if (TESTS / "dist") in Path(str(i.path)).parents]
    if not dist_items:
        raise pytest.UsageError(
            "no test under tests/dist was collected: check norecursedirs in pyproject.toml "
            "(pytest skips folders named 'dist' by default)")
