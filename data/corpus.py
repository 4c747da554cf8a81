"""The embedded default corpus: the Python standard library's own source files (code,
docstrings and comments), found through sysconfig on any machine with Python, no download.

Files are listed in sorted relative-path order so every machine with the same Python version
yields the same documents in the same order. Test suites, third-party site-packages and
build artefacts are left out: they are either huge, machine-specific or not prose-like.
"""
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
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.isdisjoint(rel.parts[:-1]) and not rel.parts[0].startswith("config-"):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_text(path) -> str:
    # A handful of stdlib files are latin-1; never fail the whole corpus on one of them.
    return Path(path).read_text(encoding="utf-8", errors="replace")
