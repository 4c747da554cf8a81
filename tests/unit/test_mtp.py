"""Multi-token prediction (models/mtp.py) against a naive per-position reference, in fp64.

The reference reads the token stream t_0..t_S directly (inputs t_0..t_{S-1}, labels
t_1..t_S): at depth k position i combines the previous depth's hidden state with the
embedding of t_{i+k} and is scored against t_{i+k+1}, for i < S - k only. It builds each
depth's input position by position and takes each cross entropy as -log softmax of one row.
"""
import dataclasses

import pytest
import torch

from models.build import build_model, init_weights
from models.config import ModelConfig, MoEConfig
from models.mtp import weighted_mtp_loss

B, S, V = 2, 9, 32


def _model(depth: int, **moe):
    m = ModelConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16,
                    mtp_depth=depth, mtp_loss_coef=0.3).validate()
    e = MoEConfig(num_experts=4, top_k=2, every=2, **moe).validate(m)
    model = init_weights(build_model(m, e, device="cpu"), seed=3).double()
    return model.train()


def _naive(model, tokens_BS1) -> torch.Tensor:
    """[K] mean cross entropies, position by position."""
    x_BS = tokens_BS1[:, :-1]
    h_BSD = model.tok_emb(x_BS)
    for block in model.blocks:
        h_BSD = block(h_BSD)
    emb = model.tok_emb.weight
    out = []
    for k, depth in enumerate(model.mtp, start=1):
        rows = []
        for i in range(S):  # past the end: any embedding (nothing valid attends to it)
            e_BD = emb[tokens_BS1[:, i + k]] if i + k <= S else torch.ones_like(h_BSD[:, 0])
            rows.append(depth.eh_proj(torch.cat([depth.enorm(e_BD), depth.hnorm(h_BSD[:, i])], -1)))
        h_BSD = depth.block(torch.stack(rows, dim=1))
        logits_BSV = model.lm_head(depth.norm(h_BSD))
        losses = [-torch.log_softmax(logits_BSV[b, i], -1)[tokens_BS1[b, i + k + 1]]
                  for b in range(B) for i in range(S - k)]
        out.append(torch.stack(losses).mean())
    return torch.stack(out)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_equals_naive_reference_fp64(depth):
    model = _model(depth)
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1], labels_BS=tokens[:, 1:])
    got = model.mtp_loss
    want = _naive(model, tokens)
    # fp64, the same operations in another order: 1e-12 relative is 4500 u of fp64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    total, terms = weighted_mtp_loss(model)
    torch.testing.assert_close(total, 0.3 / depth * want.sum(), rtol=1e-12, atol=0)
    assert terms is got
    # the main model's logits are those of a forward without labels (MTP only adds a loss)
    torch.testing.assert_close(logits, model(tokens[:, :-1]), rtol=0, atol=0)
    assert model.mtp_loss is None  # a forward without labels leaves no MTP loss behind


def test_mtp_gradient_reaches_its_depths_and_the_shared_weights():
    model = _model(2)
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(2))
    model(tokens[:, :-1], labels_BS=tokens[:, 1:])
    weighted_mtp_loss(model)[0].backward()
    for name, p in model.named_parameters():
        if name.startswith(("mtp.", "tok_emb", "blocks.")) and "router" not in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    # the main model's final norm is not on the MTP path (each depth has its own)
    assert model.norm.weight.grad is None


def test_mtp_depth_block_is_as_the_last_block():
    model = _model(1)
    assert type(model.mtp[0].block.ffn) is type(model.blocks[-1].ffn)
    dense_last = init_weights(build_model(
        ModelConfig(vocab_size=V, d_model=16, n_layers=3, n_heads=2, d_ff=32, max_seq_len=16,
                    mtp_depth=1).validate(),
        MoEConfig(num_experts=4, top_k=2, every=2), device="cpu"), seed=0)
    assert type(dense_last.mtp[0].block.ffn).__name__ == "DenseFFN"


@pytest.mark.parametrize("change, field", [
    (dict(mtp_depth=-1), "model.mtp_depth=-1"),
    (dict(mtp_depth=1, positions="learned"), "model.positions='rope'"),
    (dict(mtp_depth=1, arch="switch"), "model.arch='gpt'"),
    (dict(mtp_loss_coef=-0.1), "model.mtp_loss_coef=-0.1"),
])
def test_mtp_config_refusals_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(".", r"\.")):
        dataclasses.replace(ModelConfig(), **change).validate()


@pytest.mark.parametrize("depth, published", [(0, 249.81), (1, 259.99)])
def test_planner_prices_deepseek_v3_mtp_at_its_published_flops(depth, published):
    """DeepSeek-V3 (configs/models/deepseek_v3.toml, seq 4096) in Megatron's convention:
    249.81 GFLOP per token without MTP, 259.99 with one depth (the published figures issue
    63 cites); within 1%."""
    from parallel.planner.flops import model_costs, model_flops
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config("configs/models/deepseek_v3.toml", [f"model.mtp_depth={depth}"])
    w = workload_from_config(cfg)
    per_token = model_flops(model_costs(w.build_model(), w), w) / (w.batch_size * cfg.data.seq_len)
    assert abs(per_token / 1e9 / published - 1) < 0.01, per_token / 1e9


def test_planner_layout_shows_what_mtp_costs():
    """--layout and --json name the depths' parameters (those of the model's mtp.* tensors),
    FLOPs per token and saved elements."""
    from parallel.planner import Hardware, StateCache, predict
    from parallel.planner.flops import model_costs
    from parallel.planner.report import layout_report, pred_dict
    from trainer.config import load_config
    from trainer.planning import workload_from_config
    cfg = load_config(None, ["model.mtp_depth=2"])
    w = workload_from_config(cfg)
    model = w.build_model()
    p = predict(w, w.validate(cfg.parallel, 1), Hardware(), model_costs(model, w), StateCache(w.build_model))
    mtp = pred_dict(p)["mtp"]
    assert mtp["depths"] == 2
    assert mtp["params"] == sum(t.numel() for n, t in model.named_parameters() if n.startswith("mtp."))
    assert 0 < mtp["flops_per_token"] < p.flops_per_token
    assert "multi-token prediction (2 depths" in layout_report(p, [], [], Hardware())


@pytest.mark.parametrize("extra, says", [
    (["hf.family=llama"], "hf.family='llama' trains a transformers model"),
    (["moe.router_replay=/tmp/x.pt"], "the recorded routes cover the main model's MoE layers"),
    (["parallel.pp=2", "model.tie_embeddings=false"], "model.tie_embeddings=false"),
    (["parallel.pp=2", "parallel.zero=3"], "parallel.zero=3"),
])
def test_train_refuses_what_mtp_cannot_do_in_one_line(extra, says):
    from trainer.config import ConfigError, load_config, validate
    cfg = load_config(None, ["model.mtp_depth=1"] + extra)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 2 if any(x.startswith("parallel.pp") for x in extra) else 1)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_recording_routes_of_an_mtp_model_records_its_main_layers():
    """Decoding runs no MTP depth: the recorder is given the main model's layers."""
    from moe.aux import moe_layers
    from moe.replay import RoutingRecorder
    from models.generation import Sampling, generate
    model = _model(1).float().eval()
    main = [(n, m) for n, m in moe_layers(model) if not n.startswith("mtp.")]
    assert len(main) < len(moe_layers(model))
    with RoutingRecorder(model, main) as rec:
        generate(model, torch.randint(0, V, (2, 4)), 3, Sampling(temperature=0.0))
    assert rec.ids().shape[:2] == (2, len(main))


def test_load_profile_of_an_mtp_model_lists_its_depths_as_not_run():
    """Profiling runs the plain forward: the depths' MoE layers see no token and are listed
    apart, not reported with every expert dead."""
    from moe.profiling import profile_model
    model = _model(1).float().eval()
    report = profile_model(model, [torch.randint(0, V, (2, S))])
    assert report["not_run"] == ["mtp.0.block.ffn"]
    assert [r["name"] for r in report["layers"]] == ["blocks.1.ffn"]
