"""The README's MoE-swap snippet runs as a user copies it (issue 62, item 2): the first
```python block of README.md (and docs/huggingface.md's first, the same text), run in a
fresh interpreter from an empty directory with the project on PYTHONPATH, trains one
backward and prints its loss."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_python_snippet_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"^```python\n(.*?)^```$", text, re.S | re.M).group(1)
    (tmp_path / "snippet.py").write_text(snippet)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.fullmatch(r"loss \d+\.\d{3}", out.stdout.strip().splitlines()[-1]), out.stdout
    # docs/huggingface.md opens with the same snippet, character for character
    hf_page = (ROOT / "docs" / "huggingface.md").read_text()
    assert re.search(r"^```python\n(.*?)^```$", hf_page, re.S | re.M).group(1) == snippet


def test_huggingface_demo_runs_and_prints_what_the_docs_quote(tmp_path):
    """docs/huggingface.md's demo.py (adopt a tiny DeepSeek-V3, compare logits, export and
    reload it; issue 62, item 1: it had stopped on the router's moved settings) runs as saved
    and prints the lines the page quotes after it."""
    text = (ROOT / "docs" / "huggingface.md").read_text()
    start = text.index("Saved as `demo.py`:")
    demo = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    quoted = re.search(r"PYTHONPATH=\. python demo\.py\n(.*?)```", text[start:], re.S).group(1)
    (tmp_path / "demo.py").write_text(demo.replace("/tmp/byo/ds3", str(tmp_path / "ds3")))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "demo.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in quoted.strip().splitlines():
        assert line in out.stdout, (line, out.stdout)
