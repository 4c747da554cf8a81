"""moe.profiling: expert-load counts, JSON/PNG/TensorBoard outputs, imbalance detection.

Counts are integers and compared exactly against an independent top-k of the router logits.
"""
import collections
import json
import os

import pytest
import torch
import torch.nn as nn

from moe import MoELayer
from moe.profiling import profile_model

V, D, F, E = 50, 16, 32, 4


class Tiny(nn.Module):
    """Embedding -> dropless MoE -> MoE with capacity 1.0 -> forced-imbalance MoE."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.free = MoELayer(D, F, E, top_k=2)
        self.capped = MoELayer(D, F, E, top_k=2, capacity_factor=1.0)
        self.skewed = MoELayer(D, F, E, top_k=2)
        with torch.no_grad():
            self.emb.weight[:, 0] = 1.0                 # a constant feature every token has
            self.skewed.router.weight.zero_()
            self.skewed.router.weight[1, 0] = 100.0    # huge router rows: experts 1 and 3
            self.skewed.router.weight[3, 0] = 90.0     # take every token, 0 and 2 starve

    def forward(self, ids_BS):
        h = self.emb(ids_BS)
        h = h + self.free(h)
        h = h + self.capped(h)
        return h + self.skewed(h)


class FakeTokenizer:
    def decode(self, ids):
        return f"<{ids[0]}>"


def test_counts_outputs_and_imbalance(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    batches = [torch.randint(0, V, (3, 10)) for _ in range(4)]
    seen = []   # independent record: inputs reaching the dropless layer
    hook = model.free.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    report = profile_model(model, batches, str(tmp_path), tokenizer=FakeTokenizer(), top_n=3)
    hook.remove()
    assert model.training, "profile_model must restore the training mode"
    tokens = 4 * 3 * 10
    free, capped, skewed = report["layers"]
    assert [r["name"] for r in report["layers"]] == ["free", "capped", "skewed"]

    # dropless layer: counts == bincount of an independent top-2 of the router logits
    x_TD = torch.cat([x.reshape(-1, D) for x in seen])
    ids_TK = torch.topk(x_TD @ model.free.router.weight.detach().t(), 2, dim=-1).indices
    assert free["counts"] == torch.bincount(ids_TK.reshape(-1), minlength=E).tolist()
    assert free["tokens"] == tokens and free["dropped"] == 0
    # top tokens: each listed count equals an independent (expert, token id) count
    token_T = torch.cat(batches).reshape(-1)
    pairs = collections.Counter(zip(ids_TK.reshape(-1).tolist(),
                                    token_T.repeat_interleave(2).tolist()))
    for e, top in enumerate(free["top_tokens"]):
        assert top[0]["count"] == max(c for (ee, _), c in pairs.items() if ee == e)
        for entry in top:
            assert entry["count"] == pairs[(e, entry["id"])]
            assert entry["text"] == f"<{entry['id']}>"

    # capacity layer: counts sum to tokens * top_k minus drops
    assert sum(capped["routed"]) == tokens * 2
    assert capped["dropped"] > 0
    assert sum(capped["counts"]) == tokens * 2 - capped["dropped"]
    assert capped["dropped_fraction"] == pytest.approx(capped["dropped"] / (tokens * 2))
    assert abs(sum(capped["share"]) - 1.0) < 1e-9

    # forced imbalance: experts 1 and 3 take everything
    assert skewed["dead_experts"] == [0, 2]
    assert skewed["counts"] == [0, tokens, 0, tokens]
    assert skewed["imbalance"] == pytest.approx(2.0)
    assert skewed["cv"] == pytest.approx(1.0)
    assert free["imbalance"] < skewed["imbalance"] and free["dead_experts"] == []
    assert report["summary"]["worst_layer"] == "skewed"
    assert report["summary"]["dead_experts"] == 2
    assert 0 <= skewed["entropy"] < 0.01 < free["entropy"] <= free["entropy_max"] + 1e-6

    # files: JSON equal to the returned report, a real PNG, a TensorBoard event file
    with open(tmp_path / "load.json") as f:
        assert json.load(f) == json.loads(json.dumps(report))
    from matplotlib.image import imread
    png = imread(tmp_path / "load.png")
    assert png.ndim == 3 and png.shape[0] > 100 and png.shape[1] > 100
    tb_files = os.listdir(tmp_path / "tensorboard")
    assert any(n.startswith("events.out.tfevents") for n in tb_files)


def test_hf_encoder_decoder_streams_and_errors():
    import transformers
    from moe.hf import moefy
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.T5Config(num_layers=1, d_model=D, d_ff=F, num_heads=2, d_kv=8,
                                vocab_size=V, decoder_start_token_id=0)
    model = moefy(transformers.T5ForConditionalGeneration(cfg), num_experts=E, top_k=1)
    enc = torch.randint(0, 25, (2, 7))       # disjoint id ranges: a layer fed the wrong
    dec = torch.randint(25, V, (2, 5))       # stream would list ids from the other range
    report = profile_model(model, [{"input_ids": enc, "decoder_input_ids": dec}])
    by_name = {r["name"].split(".")[0]: r for r in report["layers"]}
    assert by_name["encoder"]["tokens"] == 14 and by_name["decoder"]["tokens"] == 10
    enc_ids = {t["id"] for top in by_name["encoder"]["top_tokens"] for t in top}
    dec_ids = {t["id"] for top in by_name["decoder"]["top_tokens"] for t in top}
    assert enc_ids <= set(enc.flatten().tolist()) and dec_ids <= set(dec.flatten().tolist())
    assert sum(by_name["decoder"]["counts"]) == 10   # top-1, dropless

    with pytest.raises(ValueError, match="no MoELayer.*moefy"):
        profile_model(nn.Linear(3, 3), [torch.zeros(1, 3)])
    with pytest.raises(ValueError, match="empty"):
        profile_model(model, [])


def test_cli_builds_from_config_and_loads_checkpoint_weights(tmp_path, capsys):
    # the [hf] section + train.py config -> model -> validation batches -> files; a small corpus
    from commands.profile import build_initialised, load_run_config, main
    cfg_file = tmp_path / "hf.toml"
    cfg_file.write_text(
        '[hf]\nfamily = "gpt2"\n[model]\nvocab_size = 256\nd_model = 32\nn_layers = 2\n'
        'n_heads = 2\nd_ff = 64\nmax_seq_len = 64\n[moe]\nnum_experts = 4\ntop_k = 2\n'
        f'every = 1\n[train]\nbatch_size = 2\n[data]\nseq_len = 32\nmax_bytes = 200000\n'
        f'cache_dir = "{tmp_path / "cache"}"\n')
    out = tmp_path / "prof"
    assert main(["--config", str(cfg_file), "--out", f"{out}/", "--batches", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'load.json'}," in printed  # "prof/" prints no "//"
    report = json.loads((out / "load.json").read_text())
    assert [r["name"] for r in report["layers"]] == [f"hf.transformer.h.{i}.mlp.moe" for i in (0, 1)]
    for r in report["layers"]:
        assert r["tokens"] == 2 * 2 * 32 and sum(r["counts"]) == r["tokens"] * 2
        assert all(isinstance(t["text"], str) for top in r["top_tokens"] for t in top)
    assert "hf.transformer.h.1.mlp.moe" in printed
    # rows per ep rank planned for the config's expert-parallel layout, with/without replicas
    assert main(["--config", str(cfg_file), "--out", str(out), "--batches", "2",
                 "parallel.ep=2", "moe.replica_slots=1"]) == 0
    for r in json.loads((out / "load.json").read_text())["layers"]:
        assert len(r["rank_rows"]) == 2 and sum(r["rank_rows"]) == sum(r["rank_rows_unreplicated"])
        assert r["rank_imbalance"] <= r["rank_imbalance_unreplicated"]
        assert r["rank_rows_source"].startswith("planned for ep=2 replica_slots=1")
    assert "rank max/mean" in capsys.readouterr().out
    assert main(["--config", str(cfg_file), "--out", str(out), "hf.family=bert"]) == 2
    assert "masked-LM" in capsys.readouterr().err

    # checkpoint weights: saved by the trainer's checkpoint code, loaded into a fresh model
    from trainer import checkpoint
    from trainer.distributed import DistContext
    cfg = load_run_config(str(cfg_file))
    par, _ = build_initialised(cfg, torch.device("cpu"))
    trained = par.model
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "")
    checkpoint.save(ctx, tmp_path / "run", 3, par, opt, {}, keep=1)
    fresh_par, _ = build_initialised(cfg, torch.device("cpu"))
    fresh = fresh_par.model
    assert not torch.equal(fresh.hf.lm_head.weight, trained.hf.lm_head.weight)
    checkpoint.load_model_weights(tmp_path / "run", fresh_par)
    for (name, a), b in zip(trained.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_rank_rows_planned_for_expert_parallel_layout():
    """One process: rows per ep rank planned for ep=(P, R) from each batch's counts."""
    torch.manual_seed(0)
    layer = MoELayer(D, F, E, top_k=2)
    with torch.no_grad():
        layer.router.selection_bias[[0, 1]] = 10.0   # every token picks experts 0 and 1
    batches = [torch.randn(2, 5, D) for _ in range(3)]
    rows = 3 * 2 * 5 * 2
    one = profile_model(nn.Sequential(layer), batches)["layers"][0]
    assert one["rank_rows"] == one["rank_rows_unreplicated"] == [rows]
    assert one["rank_rows_source"] == "measured"
    rep = profile_model(nn.Sequential(layer), batches, ep=(2, 1))["layers"][0]
    assert rep["rank_rows_unreplicated"] == [rows, 0] and rep["rank_imbalance_unreplicated"] == 2.0
    assert rep["rank_rows"] == [rows // 2, rows // 2] and rep["rank_imbalance"] == 1.0
    assert "planned for ep=2 replica_slots=1" in rep["rank_rows_source"]
    off = profile_model(nn.Sequential(layer), batches, ep=(2, 0))["layers"][0]
    assert off["rank_rows"] == off["rank_rows_unreplicated"] == [rows, 0]
