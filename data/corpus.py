"""The embedded default corpus: the Python standard library's own source files (code,
docstrings and comments), found through sysconfig on any machine with Python, no download.

Files are listed in sorted relative-path order so every machine with the same Python version
yields the same documents in the same order. Test suites, third-party site-packages and
build artefacts are left out: they are either huge, machine-specific or not prose-like.
"""
import os
import sysconfig
from pathlib import Path

_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                        "__pycache__", "lib2to3", "ensurepip", "turtledemo"})


def stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library directory {root} does not exist; "
                                f"set data.source to a folder of text files instead")
    return root


def stdlib_files(root=None) -> list:
    """Sorted list of the standard library's .py files (absolute paths)."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    # os.walk pruning the skipped folders: never descends into site-packages or the test
    # suites (rglob listed them all only to drop them: 1.5 s of every launch's start-up)
    for folder, dirs, names in os.walk(root):
        top = folder == str(root)
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not (top and d.startswith("config-"))]
        files += [Path(folder, n) for n in names
                  if n.endswith(".py") and not (top and n.startswith("config-"))]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_text(path) -> str:
    # A handful of stdlib files are latin-1; never fail the whole corpus on one of them.
    return Path(path).read_text(encoding="utf-8", errors="replace")
