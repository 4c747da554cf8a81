"""Figures the docs quote that drift as the code grows are checked, not typed (issue 62,
item 3): the number of config fields (and of the config sweep's cases, two per field) in
docs/configs.md, and the number of tests marked `lowp` in docs/getting-started.md."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from trainer.config import load_config, section_names

ROOT = Path(__file__).resolve().parents[2]


def test_configs_page_counts_the_fields():
    cfg = load_config(None, [])
    fields = sum(len(dataclasses.fields(getattr(cfg, s))) for s in section_names())
    text = (ROOT / "docs" / "configs.md").read_text()
    quoted = re.search(r"gives each of the (\d+) fields a\s+value of the wrong type and one out "
                       r"of range: all (\d+) end", text)
    assert quoted, "docs/configs.md no longer quotes the sweep's counts"
    assert (int(quoted.group(1)), int(quoted.group(2))) == (fields, 2 * fields), quoted.groups()


def test_getting_started_counts_the_lowp_tests():
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "lowp",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    per_file = re.findall(r"^tests/\S+\.py: (\d+)$", out.stdout, re.M)  # the suite's -q -q
    assert out.returncode == 0 and per_file, out.stdout[-2000:]
    collected = sum(map(int, per_file))
    text = (ROOT / "docs" / "getting-started.md").read_text()
    quoted = re.search(r"marker `lowp`, (\d+) tests", text)
    assert quoted and int(quoted.group(1)) == collected, (quoted and quoted.group(1), collected)
