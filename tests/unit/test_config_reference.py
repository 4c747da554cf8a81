"""docs/reference/config.md is generated (commands/config_reference.py) and must stay what the
generator writes now: a new field or a changed default or help fails here until the page is
regenerated. Field coverage is checked against the dataclasses themselves."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from commands.config_reference import REGENERATE, md_text, render
from trainer.config import Config

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "config.md"


def _cells(row: str) -> list:
    """A Markdown table row's cells (split on the pipes that are not escaped)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _rows(text: str) -> dict:
    return {_cells(line)[0].strip("`"): _cells(line) for line in text.splitlines()
            if line.startswith("| `")}


def test_committed_page_is_what_the_generator_writes():
    assert PAGE.is_file(), f"{PAGE} is missing; create it with `{REGENERATE}`"
    assert PAGE.read_text() == render(), (
        f"docs/reference/config.md is out of date with the config dataclasses; regenerate it "
        f"with `{REGENERATE}` and commit it")


def test_page_starts_with_the_regenerate_command():
    first = PAGE.read_text().splitlines()[0]
    assert "enerated" in first and REGENERATE in first


def test_every_field_of_every_section_has_a_row():
    rows = _rows(PAGE.read_text())
    want = [f"{sec.name}.{f.name}" for sec in dataclasses.fields(Config)
            for f in dataclasses.fields(sec.default_factory)]
    assert [name for name in want if name not in rows] == []
    assert sorted(rows) == sorted(want)  # no row for a field that no longer exists
    headings = [line[3:] for line in PAGE.read_text().splitlines() if line.startswith("## ")]
    assert headings == [sec.name for sec in dataclasses.fields(Config)]


def test_every_row_has_five_cells():
    """A `|` in a help text is escaped, so it does not split the row."""
    bad = [r for r, cells in _rows(PAGE.read_text()).items() if len(cells) != 5]
    assert bad == []
    assert md_text("a | b*c <d>") == r"a \| b\*c \<d\>"


def test_parallel_precision_row():
    field, tname, default, help_, layouts = _rows(PAGE.read_text())["parallel.precision"]
    assert (tname, default) == ("str", '`"fp32"`')
    assert "fp8" in help_ and r"fp32 \| bf16" in help_


def test_the_command_prints_the_page():
    out = subprocess.run([sys.executable, "-m", "commands.config_reference"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == render()
