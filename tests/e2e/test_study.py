"""`python -m trainer.study scaling`: a 2-point, few-step study (dense E=1 and E=2, one dense
ladder point) writes study.json / study.csv / study.png; its points differ only in the expert
count (configs compared key by key; active parameters equal); a rerun skips finished points
and resumes an interrupted one from its last checkpoint; bad input gets one line."""
import json
import shutil
import subprocess
import sys

import pytest

from tests.e2e.test_train import ROOT, TINY, cache  # noqa: F401 (cache: fixture)

pytestmark = pytest.mark.e2e


def _study(args, check=True):
    out = subprocess.run([sys.executable, "-m", "trainer.study", "scaling", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _toml(path):
    import tomllib
    return tomllib.loads(path.read_text())


def test_two_point_study_files_resume_and_skip(tmp_path, cache):
    out_dir = tmp_path / "study"
    args = ["--experts", "1,2", "--steps", "4", "--out", str(out_dir), "--dense-ladder", "2",
            *TINY, f"data.cache_dir={cache}"]
    first = _study(args)
    assert "[1/3] E1_dense" in first.stdout and "[2/3] E2" in first.stdout
    for name in ("study.json", "study.csv", "study.png"):
        assert (out_dir / name).stat().st_size > 0, name
    res = json.loads((out_dir / "study.json").read_text())
    pts = {p["point"]: p for p in res["points"]}
    assert set(pts) == {"E1_dense", "E2", "dense_x2"}
    assert pts["E1_dense"]["active_params"] == pts["E2"]["active_params"]
    assert pts["E2"]["total_params"] >= pts["E1_dense"]["total_params"]
    assert pts["dense_x2"]["active_params"] > pts["E1_dense"]["active_params"]
    for p in pts.values():
        assert p["tokens"] == 4 * 8 * 32 and len(p["evals"]) == 4
        assert p["final_val_loss"] > 0 and p["step_time_ratio"] > 0
    assert pts["E1_dense"]["step_time_ratio"] == 1.0 and pts["E1_dense"]["tokens_to_dense"] == 4 * 8 * 32
    assert set(res["fit"]["power"]) >= {"a", "b"}
    csv_lines = (out_dir / "study.csv").read_text().splitlines()
    assert csv_lines[0].startswith("point,experts,top_k,total_params,active_params") and len(csv_lines) == 4
    # the dense and the MoE point differ in the expert settings only
    dense, moe = _toml(out_dir / "E1_dense" / "config.toml"), _toml(out_dir / "E2" / "config.toml")
    diff = {(s, k) for s in dense for k in dense[s] if dense[s][k] != moe[s][k]}
    assert diff <= {("moe", "every"), ("moe", "num_experts"), ("moe", "d_ff"), ("moe", "top_k"),
                    ("run", "dir")}, diff
    assert moe["moe"]["d_ff"] * moe["moe"]["top_k"] == dense["model"]["d_ff"]
    # rerun: all done -> skipped; an interrupted point resumes from its last checkpoint
    shutil.rmtree(out_dir / "E2" / "checkpoints" / "step_00000004")
    again = _study(args)
    assert "[1/3] E1_dense: done, skipped" in again.stdout
    assert "[3/3] dense_x2: done, skipped" in again.stdout
    assert "E2 | run dir:" in again.stdout and "resuming step_00000003" in again.stdout, again.stdout[-2000:]
    assert "E2 | step 4/4" in again.stdout and "E2 | step 1/4" not in again.stdout
    res2 = json.loads((out_dir / "study.json").read_text())
    again_e2 = {p["point"]: p for p in res2["points"]}["E2"]
    assert again_e2["final_val_loss"] == pytest.approx(pts["E2"]["final_val_loss"], rel=1e-5)


def test_study_refuses_bad_input_in_one_line(tmp_path):
    out = _study(["--experts", "1,2", "--top-k", "3", "--out", str(tmp_path / "s"), "model.d_ff=64"],
                 check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--top-k 3" in out.stderr, out.stderr
    assert not (tmp_path / "s").exists()


def test_study_on_the_switch_encoder_decoder_top1(tmp_path, cache):
    out_dir = tmp_path / "switch"
    _study(["--experts", "1,2", "--top-k", "1", "--steps", "2", "--out", str(out_dir), "--dense-ladder", "",
            *TINY, f"data.cache_dir={cache}", "model.arch=switch", "model.vocab_size=384"])
    res = json.loads((out_dir / "study.json").read_text())
    pts = {p["point"]: p for p in res["points"]}
    assert set(pts) == {"E1_dense", "E2"} and res["top_k"] == 1
    assert pts["E1_dense"]["active_params"] == pts["E2"]["active_params"] < pts["E2"]["total_params"]
    assert (out_dir / "study.png").stat().st_size > 0
    assert _toml(out_dir / "E2" / "config.toml")["model"]["arch"] == "switch"


def test_study_with_two_optimizers(tmp_path, cache):
    """--optimizers adamw,muon: every point once per optimizer on the same tokens; tokens to
    dense are measured against AdamW's dense loss; the curves table lists every point."""
    out_dir = tmp_path / "opt"
    out = _study(["--experts", "1,2", "--steps", "4", "--out", str(out_dir), "--dense-ladder", "",
                  "--optimizers", "adamw,muon", *TINY, f"data.cache_dir={cache}"])
    res = json.loads((out_dir / "study.json").read_text())
    pts = {p["point"]: p for p in res["points"]}
    assert list(pts) == ["E1_dense-adamw", "E1_dense-muon", "E2-adamw", "E2-muon"]
    assert {p["optimizer"] for p in pts.values()} == {"adamw", "muon"}
    assert _toml(out_dir / "E2-muon" / "config.toml")["train"]["optimizer"] == "muon"
    assert len({p["tokens"] for p in pts.values()}) == 1  # the same token budget
    dense = pts["E1_dense-adamw"]
    assert dense["tokens_to_dense"] == dense["tokens"] and dense["step_time_ratio"] == 1.0
    for p in pts.values():  # reached AdamW's dense loss within the budget, or not (None)
        assert p["tokens_to_dense"] is None or 0 < p["tokens_to_dense"] <= p["tokens"]
        if p["tokens_to_dense"] is None:
            assert p["final_val_loss"] > dense["final_val_loss"]
    assert "validation loss at tokens" in out.stdout and "E2-muon" in out.stdout.split("validation loss at tokens")[1]
    bad = _study(["--optimizers", "adamw,adamw", "--out", str(tmp_path / "bad"), *TINY], check=False)
    assert bad.returncode == 2 and "--optimizers" in bad.stderr and not (tmp_path / "bad").exists()
