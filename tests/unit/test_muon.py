"""Muon + AdamW as one optimizer (optim/muon.py) against torch's own: 5 steps, lr changing
each step as the schedule changes it, fresh random gradients.

- 2-D hidden matrices (a tall and a wide one) equal torch.optim.Muon exactly (the same
  operations), under both update-scale rules, with and without Nesterov;
- an expert bank [E, R, C] equals torch.optim.Muon run on each expert's matrix as its own
  parameter (bf16 Newton-Schulz batched vs one at a time: 1e-6 absolute at lr 1e-2);
- the AdamW groups (decayed and not) equal torch.optim.AdamW exactly;
- the split puts Linear weights and expert weight banks under Muon, and embeddings, the
  output head, norms, biases (the banks' too), routers and the shared-expert gate under AdamW.
"""
import math

import pytest
import torch

from optim.muon import MuonAdamW

LRS = [1e-2, 8e-3, 6e-3, 4e-3, 2e-3]


def _params():
    g = torch.Generator().manual_seed(0)
    return {"tall": torch.randn(48, 32, generator=g), "wide": torch.randn(32, 48, generator=g),
            "bank": torch.randn(4, 32, 48, generator=g), "emb": torch.randn(16, 32, generator=g),
            "norm": torch.randn(32, generator=g)}


@pytest.mark.lowp
@pytest.mark.parametrize("adjust,nesterov", [("match_rms_adamw", True), ("original", False)])
def test_one_optimizer_equals_torch_muon_and_adamw(adjust, nesterov):
    init = _params()
    ours = {k: v.clone().requires_grad_() for k, v in init.items()}
    ref = {k: v.clone().requires_grad_() for k, v in init.items() if k != "bank"}
    experts = [init["bank"][e].clone().requires_grad_() for e in range(4)]
    opt = MuonAdamW([{"params": [ours["tall"], ours["wide"], ours["bank"]], "muon": True,
                      "weight_decay": 0.1},
                     {"params": [ours["emb"]], "weight_decay": 0.1},
                     {"params": [ours["norm"]], "weight_decay": 0.0}],
                    lr=LRS[0], betas=(0.9, 0.95), eps=1e-8, momentum=0.95, nesterov=nesterov,
                    adjust_lr=adjust)
    muon = torch.optim.Muon([ref["tall"], ref["wide"], *experts], lr=LRS[0], weight_decay=0.1,
                            momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW([{"params": [ref["emb"]], "weight_decay": 0.1},
                               {"params": [ref["norm"]], "weight_decay": 0.0}],
                              lr=LRS[0], betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for lr in LRS:
        for o in (opt, muon, adamw):
            for group in o.param_groups:
                group["lr"] = lr
        for k, p in ours.items():
            p.grad = torch.randn(p.shape, generator=g)
            if k == "bank":
                for e in range(4):
                    experts[e].grad = p.grad[e].clone()
            else:
                ref[k].grad = p.grad.clone()
        opt.step()
        muon.step()
        adamw.step()
        for k in ref:
            assert torch.equal(ours[k], ref[k]), k
        for e in range(4):
            torch.testing.assert_close(ours["bank"][e], experts[e], rtol=0, atol=1e-6)
    assert set(opt.state[ours["bank"]]) == {"momentum_buffer"}
    assert set(opt.state[ours["emb"]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_the_split():
    import models
    from models.config import ModelConfig, MoEConfig
    from optim.muon import split_params
    m = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=48, bias=True,
                    activation="swiglu", tie_embeddings=False)
    model = models.build_model(m, MoEConfig(num_experts=4, every=2, num_shared_experts=1,
                                            shared_expert_gate=True, router_bias=True))
    muon, rest = split_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    got = sorted(names[id(p)] for p in muon)
    want = sorted(n for n, p in model.named_parameters()
                  if n.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight"))
                  or n.split(".")[-1] in ("w1", "w2", "w3"))
    assert got == want and len(got) == 2 * 4 + 3 * 3
    adam = sorted(n for n, _ in rest)
    for name in ("tok_emb.weight", "lm_head.weight", "norm.weight", "blocks.1.ffn.router.weight",
                 "blocks.1.ffn.router.bias", "blocks.1.ffn.shared_experts.gate",
                 "blocks.1.ffn.experts.b1", "blocks.0.attn.wq.bias"):
        assert name in adam, name
    assert len(adam) + len(got) == len(list(model.parameters()))


def test_fp32_newton_schulz_is_the_same_iteration():
    """ns_dtype fp32 (train.py's default on CPU) runs torch's iteration in fp32: equal to the
    same iteration in fp64 (1e-5) for a tall matrix and a bank; its singular values land in
    the quintic's band (about 0.5-1.5, as torch.optim.Muon's docstring says of bf16)."""
    from optim.muon import NS_COEFFICIENTS, orthogonalise
    a, b, c = NS_COEFFICIENTS
    g = torch.Generator().manual_seed(2)
    for u in (torch.randn(48, 32, generator=g), torch.randn(3, 32, 48, generator=g)):
        x = u.double().mT if u.size(-2) > u.size(-1) else u.double()
        x = x / x.norm(dim=(-2, -1), keepdim=True)
        for _ in range(5):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
        want = x.mT if u.size(-2) > u.size(-1) else x
        got = orthogonalise(u, NS_COEFFICIENTS, 5, 1e-7, torch.float32)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
        s = torch.linalg.svdvals(got.double())
        assert s.min() > 0.3 and s.max() < 1.6, s


@pytest.mark.parametrize("axes, order", [
    (((3, "flat"),), ()), (((3, 0),), ()), (((3, 1),), ()),
    (((2, "copy"), (2, 0), (2, 1)), ()),          # a 2.5-D grid, depth 2
    (((2, "flat"), (3, 1)), ()),                  # ZeRO-1/2 slices of tensor-parallel blocks
    (((2, "flat"), (2, "copy"), (2, 1), (2, 0)), ()),
    (((2, 1), (3, 1)), (1, 0)),                   # FSDP2 (outer ranks) shards of etp blocks
    (((2, 0), (2, 1)), (1, 0))])                  #   (inner ranks), the same dim or another
def test_pieces_are_the_layouts_blocks(axes, order):
    """parallel/muon.py's Pieces against the blocks written out by hand: torch.chunk along each
    dim axis in the layout's cut order (axes row-major over the ranks), then the ZeRO slice
    (flatten, zero-pad to n*L, row k); assemble from the sources alone gives the matrix back."""
    from parallel.muon import Pieces
    w = torch.randn(5, 7)
    d = Pieces(None, w.shape, axes, order)
    sizes = [n for n, _ in axes]
    expected, sources = [], []
    for r in range(d.size):
        idx = [(r // math.prod(sizes[a + 1:])) % sizes[a] for a in range(len(axes))]
        block, flat_at = w, None
        for a in order or range(len(axes)):
            n, cut = axes[a]
            if isinstance(cut, int):
                chunks = block.chunk(n, cut)
                block = chunks[idx[a]] if idx[a] < len(chunks) else block.narrow(cut, 0, 0)
            elif cut == "flat":
                flat_at = (n, idx[a])
        piece = block.reshape(-1)
        if flat_at is not None:
            n, k = flat_at
            L = -(-piece.numel() // n)
            piece = torch.cat([piece, piece.new_zeros(n * L - piece.numel())])[k * L:(k + 1) * L]
        expected.append(piece)
        sources.append(all(idx[a] == 0 for a, (_, cut) in enumerate(axes) if cut == "copy"))
    got = d.cut(w)
    assert [g.numel() for g in got] == d.numels() == [e.numel() for e in expected]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert d.sources() == sources
    padded = [torch.cat([g, g.new_full((max(d.numels()) - g.numel(),), 9.0)]) if s else None
              for g, s in zip(got, sources)]   # on the wire: padded, copies absent
    assert torch.equal(d.assemble(padded), w)


def test_the_agreement_checks_tensor_lives_where_the_backend_wants_it(monkeypatch):
    """parallel/muon.py check_same_matrices' all-reduce tensor: on the current CUDA device
    under NCCL, whatever this rank holds (a rank with no matrix -- the very mismatch the check
    reports -- has no update to take a device from), on the CPU under gloo."""
    import torch.distributed as dist
    from parallel import muon
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert muon.collective_device(None) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert muon.collective_device(None) == torch.device("cpu")
