"""The shape of the tree: lower layers never import higher ones, no import circle, every
path the README has ever documented still works, and the command lines users know start.

Layers, bottom to top (docs/design.md): moe, data < models, optim < parallel < trainer <
commands. An import is read from the source (ast), at any depth in a file (function-level
imports count). `python -m` entries that hand over to commands/ do so with runpy inside a
program entry (a package's __main__.py or an `if __name__ == "__main__":` block), which no
library import executes.
"""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYER = {"moe": 0, "data": 0, "models": 1, "optim": 1, "parallel": 2, "trainer": 3, "commands": 4}


def _modules() -> dict:
    out = {}
    for pkg in LAYER:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: dict) -> set:
    """The repo modules `name` imports (resolved to the longest known module prefix)."""
    def resolve(dotted):
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        out.update(r for r in map(resolve, targets) if r and r != name)
    return out


def _graph() -> dict:
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} -> {o}" for m, outs in _graph().items() for o in outs
              if LAYER[o.split(".")[0]] > LAYER[m.split(".")[0]]]
    assert not upward, upward


def test_no_import_circle():
    graph = _graph()
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for o in graph[m]:
            if state.get(o) == "open":
                cycles.append(stack[stack.index(o):] + [o])
            elif o not in state:
                visit(o, stack + [o])
        state[m] = "done"
    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule can fail: a parallel/ file importing trainer/ is reported."""
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from trainer.config import load_config\n")
    known = {**_modules(), "parallel.x": bad}
    assert "trainer.config" in _imports("parallel.x", bad, known)


# every import path a README has documented (git log -p README.md), with its home today
DOCUMENTED = [
    ("moe", "MoELayer", "moe.layer"), ("moe", "moefy", None),
    ("moe.aux", "collect_aux_loss", None), ("moe.aux", "moe_layers", None),
    ("moe.aux", "inject_aux_loss", None),
    ("moe.hf", "save_hf", "moe.hf.export"), ("moe.hf", "load_moefied", "moe.hf.swap"),
    ("moe.swap", "save_hf", "moe.hf.export"), ("moe.swap", "load_moefied", "moe.hf.swap"),
    ("moe.profile", "profile_model", "moe.profiling"),
    ("moe.hf_build", "build_hf_model", "moe.hf.build"),
    ("models.hf_build", "build_hf_model", "moe.hf.build"),
    ("parallel.expert", "apply_expert_parallel", None), ("parallel.ledger", "CommLedger", None),
    ("parallel.ledger", "classify", None), ("parallel.apply", "parallelize", None),
    ("parallel.mesh", "rank_groups", None), ("parallel.grads", "clip_grad_norm_", None),
    ("trainer.config", "validate", None),
]


@pytest.mark.parametrize("module,name,home", DOCUMENTED)
def test_documented_import_paths_work(module, name, home):
    obj = getattr(importlib.import_module(module), name)
    if home is not None:
        assert obj is getattr(importlib.import_module(home), name)


def test_removed_apis_name_their_replacement():
    """Two documented calls whose concept was redesigned say what replaced them."""
    with pytest.raises(ImportError, match="CommLedger"):
        from parallel.expert import comm_counters  # noqa: F401
    import torch

    from parallel.grads import clip_grad_norm_
    model = torch.nn.Linear(4, 4)
    model(torch.ones(2, 4)).sum().backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert torch.allclose(clip_grad_norm_(model, 0.0), want)  # one process: torch's own clip


ENTRIES = [["train.py", "--help"], ["-m", "parallel.planner", "--help"],
           ["-m", "trainer.profile", "--help"], ["-m", "trainer.study", "--help"],
           ["-m", "moe.profile", "--help"], ["-m", "data.prepare", "--help"],
           ["-m", "commands.config_reference", "--help"]]


def test_every_documented_command_starts():
    procs = [(e, subprocess.Popen([sys.executable, *e], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)) for e in ENTRIES]
    for entry, p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and ("usage" in out.lower() or "parallel.ep" in out), (entry, out[-500:])
