"""The outputs the docs show stay true.

Every command block in docs/, and every ```python block there and in README.md, carries a
mark on the line before its fence:
  <!-- run: ci -->                      short and deterministic: run here, quoted lines checked
                                        (a python block: saved and run as a script from an
                                        empty directory with the project on PYTHONPATH, as a
                                        user copies it; /tmp/byo paths point into that dir)
  <!-- run: bench YYYY-MM-DD <commit> --> long: when, and at which commit, it printed what is shown
  <!-- run: test <tests/...py> -->      a python block that test runs (and checks what it prints)
  <!-- run: no, <why> -->                not re-run (a GPU, several nodes, a process group, ...)
The count of blocks not run here is reported as a warning at the end of the run.

A ci block's command runs from the repository root (train.py's run.dir pointed at a tmp dir),
and every line quoted after it must appear in its output, in order: numbers exactly, except
the timings of a CPU run (tok/s, TFLOP/s, mfu, eta), which are matched by pattern. `...` lines
stand for output left out. docs/reference/ is generated (not hand-written) and not scanned.
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARK = re.compile(r"^<!-- run: (ci|bench \d{4}-\d\d-\d\d [0-9a-f]{7,40}|test tests/\S+\.py|no, .+) -->$")
COMMAND_LANGS = {"bash", "sh", "shell", "console"}
# a CPU run's timings: the value after these words is matched by pattern, not by value
TIMING = re.compile(r"((?:tok/s|TFLOP/s|mfu|eta) )(\S+)")


def doc_pages():
    return sorted(p for p in DOCS.rglob("*.md") if "reference" not in p.relative_to(DOCS).parts)


def blocks(text: str):
    """Fenced blocks: dicts with line (1-based, the fence), lang, body (lines), mark (or None)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            mark = MARK.match(lines[i - 1]) if i else None
            out.append({"line": i + 1, "lang": lines[i][3:].strip(), "body": lines[i + 1:j],
                        "mark": mark.group(1) if mark else None,
                        "raw_mark": lines[i - 1] if i and lines[i - 1].startswith("<!--") else None})
            i = j + 1
        else:
            i += 1
    return out


def is_command(block) -> bool:
    return block["lang"] in COMMAND_LANGS or any(l.startswith("$ ") for l in block["body"])


def _join(lines):
    """Shell lines with trailing backslashes joined into commands."""
    cmds, cur = [], ""
    for l in lines:
        cur += l.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        cmds.append(cur.strip())
        cur = ""
    return [c for c in cmds if c]


def ci_cases(path: Path):
    """(id, command, quoted output lines) for each ci-marked block of a page."""
    bs, out = blocks(path.read_text()), []
    for k, b in enumerate(bs):
        if b["mark"] != "ci" or b["lang"] == "python":
            continue
        body = b["body"]
        if any(l.startswith("$ ") for l in body):
            first = next(i for i, l in enumerate(body) if l.startswith("$ "))
            end = first
            while body[end].rstrip().endswith("\\"):
                end += 1
            cmd = _join([body[first][2:]] + body[first + 1:end + 1])[0]
            quoted = body[end + 1:]
        else:
            cmd = _join([l for l in body if not l.lstrip().startswith("#")])[0]
            quoted = bs[k + 1]["body"] if k + 1 < len(bs) and not is_command(bs[k + 1]) else []
        out.append((f"{path.name}:{b['line']}", cmd, quoted))
    return out


def argv(cmd: str, tmp: Path):
    """The command as an argv run from the repo root: `python` is this interpreter, train.py's
    run.dir a fresh directory under tmp."""
    args = shlex.split(cmd, comments=True)
    if args and args[0] == "python":
        args[0] = sys.executable
    if "train.py" in args:
        args = [a for a in args if not a.startswith("run.dir=")] + [f"run.dir={tmp / 'run'}"]
    return args


def line_pattern(quoted: str) -> re.Pattern:
    parts, pos = [], 0
    for m in TIMING.finditer(quoted):
        parts.append(re.escape(quoted[pos:m.end(1)]))
        parts.append(r"\S+")
        pos = m.end()
    parts.append(re.escape(quoted[pos:]))
    return re.compile("".join(parts))


def check(quoted, output: str) -> list:
    """The quoted lines not found in output (in order; '...' and blank lines skipped)."""
    got = [l.rstrip() for l in output.splitlines()]
    missing, at = [], 0
    for q in quoted:
        if not q.strip() or q.strip() == "...":
            continue
        pat = line_pattern(q.rstrip())
        for i in range(at, len(got)):
            if pat.fullmatch(got[i]):
                at = i + 1
                break
        else:
            missing.append(q)
    return missing


def run_case(cmd: str, quoted, tmp: Path):
    proc = subprocess.run(argv(cmd, tmp), cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    return proc.returncode, out, check(quoted, out)


CASES = [c for p in doc_pages() for c in ci_cases(p)]


def test_every_command_in_docs_is_marked():
    unmarked = [f"{p.relative_to(ROOT)}:{b['line']} {b['raw_mark'] or '(no mark)'}"
                for p in doc_pages() for b in blocks(p.read_text()) if is_command(b) and not b["mark"]]
    assert not unmarked, unmarked
    assert CASES, "no ci-marked command in docs/"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_docs_output_is_true(case, tmp_path):
    where, cmd, quoted = case
    rc, out, missing = run_case(cmd, quoted, tmp_path)
    assert rc == 0, f"{where}: `{cmd}` exited {rc}\n{out[-3000:]}"
    assert not missing, f"{where}: `{cmd}` no longer prints:\n" + "\n".join(missing) + \
        f"\n--- it printed:\n{out[-3000:]}"


FAKE = """# page

<!-- run: ci -->
```
$ python -c "print('step 2/2 loss 4.9994 tok/s 6567 TFLOP/s 0.0453 eta 0m00s'); print('peak 47.04 GB')"
step 2/2 loss {loss} tok/s 1 TFLOP/s 9.9 eta 0m09s
...
peak 47.04 GB
```

<!-- run: no, needs a GPU -->
```bash
python train.py run.device=cuda
```
"""


@pytest.mark.parametrize("loss,ok", [("4.9994", True), ("4.9995", False)])
def test_the_checker_catches_a_changed_number(tmp_path, loss, ok):
    """A quoted loss changed by one in the last digit fails; the timings never do."""
    page = tmp_path / "page.md"
    page.write_text(FAKE.format(loss=loss))
    (case,) = ci_cases(page)
    rc, out, missing = run_case(case[1], case[2], tmp_path)
    assert rc == 0, out
    assert (not missing) is ok, missing
    if not ok:
        assert missing == [f"step 2/2 loss {loss} tok/s 1 TFLOP/s 9.9 eta 0m09s"]


def test_an_unmarked_command_is_found(tmp_path):
    text = FAKE.format(loss="1").replace("<!-- run: no, needs a GPU -->\n", "")
    unmarked = [b for b in blocks(text) if is_command(b) and not b["mark"]]
    assert [b["body"] for b in unmarked] == [["python train.py run.device=cuda"]]


# ```python blocks (README.md and docs/) ------------------------------------------------------
def python_blocks():
    """(page, block) for every python block a user can copy."""
    return [(p, b) for p in [ROOT / "README.md"] + doc_pages() for b in blocks(p.read_text())
            if b["lang"] == "python"]


PY_CASES = [(f"{p.name}:{b['line']}", b["body"]) for p, b in python_blocks() if b["mark"] == "ci"]


def test_every_python_block_is_marked_and_its_test_exists():
    blocks_ = python_blocks()
    unmarked = [f"{p.relative_to(ROOT)}:{b['line']}" for p, b in blocks_ if not b["mark"]]
    assert not unmarked, unmarked
    for p, b in blocks_:
        if b["mark"].startswith("test "):
            test = ROOT / b["mark"].split()[1]
            assert test.is_file() and p.name in test.read_text(), (p.name, b["line"], b["mark"])
    assert PY_CASES, "no ci-marked python block"


@pytest.mark.parametrize("where, body", PY_CASES, ids=[c[0] for c in PY_CASES])
def test_python_snippet_runs_as_copied(where, body, tmp_path):
    code = "\n".join(body).replace("/tmp/byo", str(tmp_path / "byo"))
    (tmp_path / "snippet.py").write_text(code + "\n")
    env = dict(__import__("os").environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{where}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"


def test_docs_report_the_blocks_not_run_here():
    """The blocks not re-run here (bench: dated output; no: why), counted and reported."""
    import warnings
    marks = [b["mark"] for p in doc_pages() for b in blocks(p.read_text())
             if (is_command(b) or b["lang"] == "python") and b["mark"]]
    marks += [b["mark"] for p, b in python_blocks() if p.name == "README.md" and b["mark"]]
    bench = sum(m.startswith("bench ") for m in marks)
    no = sum(m.startswith("no, ") for m in marks)
    ran = sum(m == "ci" or m.startswith("test ") for m in marks)
    assert ran and bench + no + ran == len(marks)
    warnings.warn(f"docs: {ran} blocks run here, {bench + no} not ({bench} dated bench outputs, "
                  f"{no} that cannot run here)", UserWarning)
