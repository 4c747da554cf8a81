"""train.py writes expert-load profiles at intervals (log.profile_every), and refuses them
where a rank cannot run the whole model (pipeline parallelism)."""
import json

import pytest

from tests.e2e.test_train import TINY, train

pytestmark = pytest.mark.e2e


def test_profiles_written_at_intervals_with_consistent_counts(tmp_path):
    run = tmp_path / "run"
    train(TINY + [f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={run}", "train.steps=4",
                  "moe.every=1", "log.profile_every=2", "log.profile_batches=1"], tmp_path)
    steps = sorted(p.name for p in (run / "profile").iterdir())
    assert steps == ["step_0000002", "step_0000004"]
    report = json.loads((run / "profile" / "step_0000004" / "load.json").read_text())
    assert [layer["name"] for layer in report["layers"]] == ["blocks.0.ffn", "blocks.1.ffn"]
    for layer in report["layers"]:
        # one held-out batch: 8 sequences of 32 inputs, top-2, dropless
        assert sum(layer["counts"]) == 8 * 32 * 2
        assert len(layer["counts"]) == 4
    png = (run / "profile" / "step_0000004" / "load.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_interval_refused_under_pipeline(tmp_path):
    out = train(TINY + [f"run.dir={tmp_path / 'run'}", "parallel.pp=2", "parallel.dp=1", "parallel.microbatches=2",
                        "model.tie_embeddings=false", "log.profile_every=2"], tmp_path, nproc=2,
                check=False)
    assert out.returncode != 0
    assert "log.profile_every" in out.stderr + out.stdout
