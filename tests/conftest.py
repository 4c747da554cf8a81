"""Suite-wide guard: a run over the whole tests/ folder must collect the multi-process proofs.

pytest skips folders named `dist` by default (norecursedirs), which once kept tests/dist out
of CI without a word. pyproject.toml overrides that; this hook makes any regression loud.
"""
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection: count what was collected
def pytest_collection_modifyitems(session, config, items):
    targets = [Path(a.split("::")[0]).resolve() for a in config.args] or [TESTS]
    if TESTS not in targets:
        return  # a narrower run (tests/unit, one file) is the user's choice
    dist_items = [i for i in items if (TESTS / "dist") in Path(str(i.path)).parents]
    if not dist_items:
        raise pytest.UsageError(
            "no test under tests/dist was collected: check norecursedirs in pyproject.toml "
            "(pytest skips folders named 'dist' by default)")
