"""train.py under torchrun with declared nodes (parallel.gpus_per_node=2: 4 ranks as 2 nodes
of 2, parallel.ep=4): moe.dispatch=hierarchical with moe.max_nodes=1 gives the losses of the
flat dispatch routed with one expert group per node (moe.n_group=2, moe.topk_group=1, top-2:
the same routing by construction), and its metrics.jsonl shows fewer expert all-to-all bytes
across nodes (comm_bytes_a2a_nodes) than the flat run's.

Tolerance: losses 1e-5 relative over 5 steps (only the combine's summation order differs,
AdamW amplifies last bits, as tests/e2e/test_replication_train.py).
"""
import pytest

from tests.e2e.test_train import TINY, close, losses, records, train

pytestmark = pytest.mark.e2e


def _inter(run_dir, step):
    rec = next(r for r in records(run_dir) if r["step"] == step)
    split = rec["comm_bytes_a2a_nodes"]["expert_all_to_all"]
    return sum(split.get("inter_node", {}).values()), rec["comm_bytes"]["expert_all_to_all"]


def test_hierarchical_max_nodes_same_losses_fewer_bytes_across_nodes(tmp_path):
    common = TINY + [f"data.cache_dir={tmp_path / 'cache'}", "train.steps=5", "parallel.dp=4",
                     "parallel.ep=4", "parallel.gpus_per_node=2", "checkpoint.every=0",
                     "checkpoint.at_end=false", "log.tensorboard=false", "log.progress=none"]
    flat, hier = tmp_path / "flat", tmp_path / "hier"
    train(common + [f"run.dir={flat}", "moe.n_group=2", "moe.topk_group=1"], tmp_path, nproc=4)
    train(common + [f"run.dir={hier}", "moe.dispatch=hierarchical", "moe.max_nodes=1"],
          tmp_path, nproc=4)
    ref, got = losses(flat), losses(hier)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5]
    for step in ref:
        assert close(got[step], ref[step], 1e-5), (step, got[step], ref[step])
    for step in ref:
        (flat_inter, flat_all), (hier_inter, hier_all) = _inter(flat, step), _inter(hier, step)
        # max_nodes=1: every token's 2 experts share a node, so it crosses at most once
        assert 0 < hier_inter < flat_inter, (step, hier_inter, flat_inter)
        assert flat_inter < flat_all and hier_inter < hier_all


def test_node_settings_refused_in_one_line(tmp_path):
    out = train(TINY + ["moe.dispatch=hierarchical", f"run.dir={tmp_path / 'r'}"], tmp_path, check=False)
    assert out.returncode != 0
    assert "moe.dispatch=hierarchical works on the nodes of the expert-parallel group, but " \
           "parallel.ep=1" in out.stderr, out.stderr[-2000:]
