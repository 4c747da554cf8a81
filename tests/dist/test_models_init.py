"""init_weights after parallelisation equals the one-process init (2 gloo processes).

A GPT is built on meta, parallelised, then materialised with init_weights; each rank
compares with a one-process model initialised from the same seed. Weights must be
bit-identical (same random draws, only sliced), so the tolerance is exact equality; the
expert-parallel forward is compared at 1e-5 (only summation order differs).
Layouts: expert parallel (ep=2 via shard_layer_experts) and FSDP2 fully_shard (ZeRO-3).
"""
import pytest
import torch
import torch.distributed as dist

from models import ModelConfig, MoEConfig, build_model, count_params, init_weights, moe_layers
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

SEED = 5


def _cfgs(tie):
    return (ModelConfig(vocab_size=32, d_model=16, n_layers=4, n_heads=2, d_ff=24,
                        max_seq_len=16, tie_embeddings=tie),
            MoEConfig(num_experts=4, top_k=2, every=2))


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _ep_case(rank, world):
    from moe.ep_dispatcher import shard_layer_experts
    dev = _device()
    ref = build_model(*_cfgs(True), device=dev, seed=SEED)
    model = build_model(*_cfgs(True))
    for _, layer in moe_layers(model):
        shard_layer_experts(layer, dist.group.WORLD)
    init_weights(model, SEED, dev)
    L = 4 // world
    rows = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = ref_params[name]
        if ".experts." in name:
            want = want[rank * L:(rank + 1) * L]
        rows.append((f"ep {name}", torch.equal(p, want)))
    rows.append(("ep tied", model.lm_head.weight is model.tok_emb.weight))
    rows.append(("ep count_params", count_params(model) == count_params(ref)))
    torch.manual_seed(rank)
    ids = torch.randint(0, 32, (2, 12), device=dev)
    rows.append(("ep forward", torch.allclose(model(ids), ref(ids), atol=1e-5, rtol=1e-5)))
    return rows


def _fsdp_case(rank, world, tie):
    from torch.distributed.fsdp import fully_shard
    dev = _device()
    ref = build_model(*_cfgs(tie), device=dev, seed=SEED)
    model = build_model(*_cfgs(tie))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    init_weights(model, SEED, dev)
    rows = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        rows.append((f"fsdp tie={tie} {name}", torch.equal(p.full_tensor(), ref_params[name])))
    ids = torch.randint(0, 32, (2, 12), device=dev)
    rows.append((f"fsdp tie={tie} forward", torch.allclose(model(ids), ref(ids), atol=1e-5, rtol=1e-5)))
    return rows


def _worker(rank, world):
    return _ep_case(rank, world) + _fsdp_case(rank, world, False) + _fsdp_case(rank, world, True)


def test_init_after_parallelisation_matches_one_process():
    for rank, rows in enumerate(run_distributed(_worker, 2, timeout=180)):
        failed = [name for name, ok in rows if not ok]
        assert not failed, f"rank {rank}: {failed}"
        assert len(rows) > 20
