"""Multi-token prediction through train.py (issue 63), and DeepSeek-V3 checkpoints with their
MTP layer in and out of a run.

- model.mtp_depth=2 on the tiny MoE GPT: every step logs mtp_loss_1 and mtp_loss_2, the
  main loss differs from a run without MTP only through training (equal at step 1: the MTP
  loss is added, not mixed in), and dp2 x ep2, pp2 (1F1B, the depths on the last stage) and
  dp2 x ep2 with the all-to-all overlap (a2a_overlap=1f1b over micro-batches of 2) log one
  process's main and MTP losses
  (1e-4 relative, tests/e2e/test_train.py's rule); its checkpoint resumes under one process;
  trainer.generate --speculative mtp prints the plain greedy text and an acceptance rate.
- hf.weights: a DeepSeek-V3-shaped checkpoint (a tiny transformers DeepseekV3ForCausalLM's
  tensors in the published names, with an MTP layer) starts a dp2 x ep2 run (each rank takes
  its experts); one step at lr 1e-30 with the bias update off changes nothing, and
  commands.export_hf writes back every tensor of the checkpoint byte for byte, plus a
  config.json with num_nextn_predict_layers.
"""
import json
import subprocess
import sys

import pytest
import torch

from tests.e2e.test_train import TINY, cache, close, records, resume_after_step3, train  # noqa: F401

pytestmark = pytest.mark.e2e
ROWS = ["train.steps=6", "checkpoint.every=3"]


def _mtp(run_dir) -> dict:
    return {r["step"]: (r["loss"], r["mtp_loss_1"], r["mtp_loss_2"]) for r in records(run_dir)}


def test_mtp_trains_under_dp_ep_like_one_process_and_resumes(tmp_path, cache):
    common = TINY + ROWS + [f"data.cache_dir={cache}", "model.mtp_depth=2"]
    one, par, off = tmp_path / "one", tmp_path / "par", tmp_path / "off"
    out = train(common + [f"run.dir={one}", "log.every=1"], tmp_path)
    line = next(s for s in out.stdout.splitlines() if s.startswith("step 1/"))
    assert " mtp " in line, line  # the log line shows the depths' losses
    train(common + ["parallel.dp=2", "parallel.ep=2", f"run.dir={par}"], tmp_path, nproc=2)
    pipe = tmp_path / "pipe"  # the depths on the last stage, the embedding through the tied head
    train(common + ["parallel.pp=2", "parallel.microbatches=2", f"run.dir={pipe}"], tmp_path, nproc=2)
    lap = tmp_path / "overlap"  # micro-batch i+1's forward beside i's backward, depths included
    train(common + ["parallel.dp=2", "parallel.ep=2", "parallel.a2a_overlap=1f1b",
                    "train.micro_batch_size=2", f"run.dir={lap}"], tmp_path, nproc=2)
    ref = _mtp(one)
    for got in (_mtp(par), _mtp(pipe), _mtp(lap)):
        assert sorted(got) == list(range(1, 7))
        for step in ref:
            for a, b in zip(got[step], ref[step]):
                assert close(a, b, 1e-4), (step, got[step], ref[step])
    train(TINY + ROWS + [f"data.cache_dir={cache}", f"run.dir={off}"], tmp_path)
    plain = {r["step"]: r["loss"] for r in records(off)}
    assert close(plain[1], ref[1][0], 1e-6)  # same weights and batch: the MTP adds a loss only
    assert all("mtp_loss_1" not in r for r in records(off))
    resume_after_step3(par, common, tmp_path, {s: v[0] for s, v in ref.items()}, 1e-4)
    # greedy text of the trained checkpoint: the same with the MTP depth drafting
    texts = {}
    for mode in ("off", "mtp"):
        done = subprocess.run([sys.executable, "-m", "trainer.generate", str(one), "--prompt",
                               "def f(x):", "--temperature", "0", "--max-new-tokens", "40",
                               "--speculative", mode], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        texts[mode] = done.stdout.split("--- sample 1", 1)[1].split("MTP drafts")[0]
    assert texts["mtp"] == texts["off"]
    assert "MTP drafts accepted: " in done.stdout, done.stdout[-500:]


def _tiny_deepseek(tmp_path):
    """(directory with config.json + model.safetensors in fp32, the checkpoint's tensors)."""
    import transformers
    from safetensors.torch import save_file

    from tests.unit.test_hf_weights import _checkpoint_names, _with_mtp_layer
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    ckpt = _with_mtp_layer(_checkpoint_names(model.double()), 2, 32)
    ckpt = {n: t.float().contiguous() for n, t in ckpt.items()}
    d = tmp_path / "deepseek"
    d.mkdir()
    save_file(ckpt, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(dict(cfg.to_dict(), num_nextn_predict_layers=1)))
    return d, ckpt


def test_deepseek_v3_weights_with_mtp_go_through_a_run_byte_for_byte(tmp_path, cache):
    from safetensors.torch import load_file
    src, ckpt = _tiny_deepseek(tmp_path)
    run, out = tmp_path / "run", tmp_path / "export"
    train([f"hf.config={src / 'config.json'}", f"hf.weights={src}", "model.mtp_depth=1",
           "moe.bias_update_rate=0", "train.lr=1e-30", "train.warmup_steps=0", "train.steps=1",
           "data.seq_len=32", "train.batch_size=4", "data.max_bytes=1000000", "train.eval_every=0",
           "parallel.dp=2", "parallel.ep=2", f"data.cache_dir={cache}", f"run.dir={run}"],
          tmp_path, nproc=2)
    done = subprocess.run([sys.executable, "-m", "commands.export_hf", str(run), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(ckpt), set(back) ^ set(ckpt)
    changed = [n for n in ckpt if not torch.equal(back[n], ckpt[n])]
    assert not changed, changed[:5]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
