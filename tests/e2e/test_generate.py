"""`python -m trainer.generate`, `python -m trainer.evaluate` and `moe.router_replay` end to end
(issue 33 parts 2-4), on a checkpoint written by a 2-process dp2 x ep2 run (experts sharded)
and loaded into one process.

- generate: greedy decoding with the KV cache prints the same text as without it; a seed
  repeats a sample; bad input gets one line and exit code 2.
- evaluate: on the run's held-out set its loss equals the val_loss train.py logged at that
  step (the run trains dropless; 1e-5 relative, fp32 summation order); on a folder of text, bits
  per byte is the summed loss in bits over the bytes predicted (byte tokenizer: one per token
  but the separators).
- record/replay round trip: generate --record-routing writes 8 sequences with every MoE layer's
  choices; the ids are then changed (each expert + 1 mod E) so they differ from anything the
  router would choose, and train.py trains on the record from the run's weights
  (checkpoint.init_from) in one process and under dp2 x ep2. Step 1's loss equals the replayed
  forward computed here with moe.replay (1e-5 relative); the same forward with the router's own
  choice is more than 1e-4 away (6e-4 at this seed: the check can fail); the ep2 run's losses equal the one-process run's
  (1e-4 relative, reduction order: see test_train.py).
"""
import contextlib
import io
import json

import pytest
import torch

from tests.e2e.launch import run_all
from tests.e2e.test_train import close, losses, records, train

pytestmark = pytest.mark.e2e
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "moe.num_experts=4", "moe.every=1", "data.seq_len=32", "train.batch_size=8",
        "data.max_bytes=1000000", "log.moe_stats_every=0", "train.warmup_steps=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A dp2 x ep2 run, dropless, evaluated and saved at its last step (4)."""
    tmp = tmp_path_factory.mktemp("gen")
    run_dir = tmp / "base"
    train(TINY + [f"data.cache_dir={tmp / 'cache'}", f"run.dir={run_dir}", "train.steps=4",
                  "train.eval_every=4", "parallel.dp=2", "parallel.ep=2"], tmp, nproc=2)
    return tmp, run_dir


def cli(module: str, *argv) -> tuple:
    """(exit code, stdout, stderr) of a command's main, run in this process."""
    import importlib
    main = importlib.import_module(f"commands.{module}").main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def samples(stdout: str) -> list:
    return stdout.split("--- sample ")[1:]


def test_generate_cache_equals_no_cache_seed_repeats_and_bad_input(base):
    tmp, run_dir = base
    greedy = ["--prompt", "def main(", "--max-new-tokens", 20, "--temperature", 0]
    code, cached, _ = cli("generate", run_dir, *greedy)
    assert code == 0 and "KV cache" in cached and "dropless" in cached
    assert "step 4, written by 2 rank(s)" in cached
    code, full, _ = cli("generate", run_dir, *greedy, "--no-cache")
    assert code == 0 and "no cache" in full
    assert samples(cached) == samples(full) and samples(cached)[0].count("def main(") >= 1
    sampled = ["--prompt", "import ", "--max-new-tokens", 16, "--top-k", 20, "--num-samples", 2]
    one, two = cli("generate", run_dir, *sampled, "--seed", 5), cli("generate", run_dir, *sampled, "--seed", 5)
    assert one[0] == 0 and len(samples(one[1])) == 2 and samples(one[1]) == samples(two[1])
    for argv, words in (((tmp, "--prompt", "x"), "not a train.py run directory"),
                        ((run_dir, "--prompt", "x", "--step", 3), "complete checkpoints: 4"),
                        ((run_dir, "--prompt", "x" * 300), "longer than the model's context"),
                        ((run_dir, "--prompt", "x", "--max-new-tokens", 300), "--max-new-tokens <= 256"),
                        ((run_dir, "--prompt", "x", "--top-p", 0), "--top-p=0")):
        code, _, err = cli("generate", *argv)
        assert code == 2 and err.count("\n") == 1 and words in err, (argv, err)
    # a shape-changing override: one line naming the field (was a DCP size mismatch traceback)
    code, _, err = cli("evaluate", run_dir, "model.d_model=64")
    assert code == 2 and err.count("\n") == 1, err
    assert "model.d_model: 32 -> 64: the checkpoint" in err and "drop the override" in err, err


def test_evaluate_matches_the_runs_val_loss_and_counts_bytes(base, tmp_path):
    tmp, run_dir = base
    val_loss = [r["val_loss"] for r in records(run_dir) if "val_loss" in r]
    code, out, _ = cli("evaluate", run_dir, "--json")
    got = json.loads(out)
    assert code == 0 and close(got["loss"], val_loss[-1], 1e-5), (got["loss"], val_loss)
    assert got["tokens"] == 4 * 8 * 32 and abs(got["perplexity"] - torch.tensor(got["loss"]).exp()) < 1e-4
    assert [layer["name"] for layer in got["layers"]] == ["blocks.0.ffn", "blocks.1.ffn"]
    assert all(sum(layer["counts"]) == got["tokens"] * 2 for layer in got["layers"])  # dropless
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "a.txt").write_text("héllo wörld, " * 40)
    (folder / "b.txt").write_text("the quick brown fox " * 30)
    code, out, _ = cli("evaluate", run_dir, "--data", folder, "--split", "all", "--json")
    got = json.loads(out)
    stream = list("héllo wörld, ".encode() * 40) + [0] + list(b"the quick brown fox " * 30) + [0]
    n = (len(stream) - 1) // 32
    targets = [t for i in range(n) for t in stream[i * 32 + 1: i * 32 + 33]]
    assert code == 0 and got["tokens"] == n * 32 and got["bytes"] == sum(t != 0 for t in targets)
    assert abs(got["bits_per_byte"] - got["loss"] * got["tokens"] / got["bytes"] / 0.6931471805599453) < 1e-9
    code, out, _ = cli("evaluate", run_dir, "--data", folder)
    assert code == 0 and "loss " in out and "bits/byte" in out and "blocks.1.ffn" in out


def test_record_and_replay_round_trip_through_train_py(base):
    from moe.replay import replaying
    from trainer.inference import load_run
    from trainer.router_record import FORMAT
    from trainer.tasks import token_loss
    tmp, run_dir = base
    rec = tmp / "rollouts.pt"
    code, out, _ = cli("generate", run_dir, "--prompt", "def ", "--max-new-tokens", 29,
                       "--num-samples", 8, "--temperature", 0.9, "--record-routing", rec)
    assert code == 0 and "data.seq_len=32" in out
    data = torch.load(rec, weights_only=True)
    assert data["format"] == FORMAT and data["tokens"].shape == (8, 33)
    assert data["expert_ids"].shape == (8, 2, 32, 2)
    data["expert_ids"] = (data["expert_ids"] + 1) % 4   # experts the router did not choose
    torch.save(data, tmp / "moved.pt")

    common = TINY + [f"data.cache_dir={tmp / 'cache'}", "train.steps=3", "train.eval_every=0",
                     f"checkpoint.init_from={run_dir}", f"moe.router_replay={tmp / 'moved.pt'}"]
    one, ep2 = tmp / "replay1", tmp / "replay_ep2"
    results = run_all([(1, common + [f"run.dir={one}"]),
                       (2, common + [f"run.dir={ep2}", "parallel.dp=2", "parallel.ep=2"])], tmp)
    for code, log in results:
        assert code == 0, log[-3000:]
    assert "router replay: training on the 8 recorded sequences" in results[0][1]

    run = load_run(run_dir)
    x, y = data["tokens"][:, :-1], data["tokens"][:, 1:]
    with torch.no_grad(), replaying(run.model, data["expert_ids"].long()):
        replayed = float(token_loss(run.model(x), y))
    with torch.no_grad():
        own = float(token_loss(run.model(x), y))
    got = losses(one)
    assert close(got[1], replayed, 1e-5), (got[1], replayed)
    assert not close(got[1], own, 1e-4), (got[1], own)  # 6e-4 apart at this seed
    got2 = losses(ep2)
    for step in (1, 2, 3):
        assert close(got2[step], got[step], 1e-4), (step, got2[step], got[step])
    bad = train(TINY + [f"data.cache_dir={tmp / 'cache'}", "train.steps=1", f"run.dir={tmp / 'bad'}",
                        f"moe.router_replay={tmp / 'moved.pt'}", "data.seq_len=16"], tmp, check=False)
    assert bad.returncode != 0 and "set data.seq_len=32" in bad.stderr + bad.stdout


def test_switch_generates_from_the_encoder_prompt(base, tmp_path):
    """The encoder-decoder path: the prompt's <extra_id_N> are sentinels, the target decoded
    greedily prints the same text twice; evaluate reports the span-corruption loss, no bits/byte."""
    tmp, _ = base
    run_dir = tmp_path / "switch"
    train(["model.arch=switch", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
           "model.d_ff=64", "model.vocab_size=320", "moe.num_experts=4", "data.seq_len=32",
           "train.batch_size=8", "data.max_bytes=1000000", "train.steps=2", "train.eval_every=0",
           f"data.cache_dir={tmp / 'cache'}", f"run.dir={run_dir}"], tmp_path)
    argv = (run_dir, "--prompt", "def f(<extra_id_0>): return <extra_id_1>", "--max-new-tokens",
            6, "--temperature", 0)
    (code, out, _), again = cli("generate", *argv), cli("generate", *argv)
    assert code == 0 and "encoder-decoder" in out and samples(out) == samples(again[1])
    code, out, _ = cli("evaluate", run_dir, "--json")
    got = json.loads(out)
    assert code == 0 and got["bits_per_byte"] is None and got["loss"] > 0
