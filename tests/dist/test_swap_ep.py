"""A moefied Hugging Face model under expert parallelism equals the one-process model.

World 2, experts split 2 + 2, each rank holds half of the batch. Checked: logits, the
loss including aux losses, local expert-weight gradients and (all-reduced) router
gradients. Tolerance 1e-5 absolute (fp32; only summation order differs).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist.harness import run_distributed

V, D, FF, B, S = 64, 16, 32, 4, 6
TOL = dict(atol=1e-5, rtol=1e-5)


def _model():
    import transformers
    from moe.hf import moefy
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, n_inner=FF, vocab_size=V,
                                  n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = moefy(transformers.GPT2LMHeadModel(cfg), num_experts=4, top_k=2, router_init_std=0.3)
    return model.train()


def _loss(model, ids, n_total, world):
    from moe.aux import collect_aux_loss
    logits = model(input_ids=ids).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum")
    return logits, ce / n_total + collect_aux_loss(model) / world


def _worker(rank, world):
    from moe.aux import moe_layers
    from parallel.expert import apply_expert_parallel
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    n_total = B * (S - 1)
    ref = _model()
    ref_logits, ref_loss = _loss(ref, ids, n_total, 1)
    ref_loss.backward()

    model = _model()
    apply_expert_parallel(model, dist.group.WORLD)
    rows = slice(rank * B // world, (rank + 1) * B // world)
    logits, loss = _loss(model, ids[rows], n_total, world)
    loss.backward()
    torch.testing.assert_close(logits, ref_logits[rows], **TOL)
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), **TOL)
    for (_, layer), (_, ref_layer) in zip(moe_layers(model), moe_layers(ref)):
        n = layer.experts.num_local
        assert n == 2
        want = ref_layer.experts.w1.grad[rank * n:(rank + 1) * n]
        torch.testing.assert_close(layer.experts.w1.grad, want, **TOL)
        router = layer.router.weight.grad.clone()
        dist.all_reduce(router)
        torch.testing.assert_close(router, ref_layer.router.weight.grad, **TOL)
    return float(total)


@pytest.mark.dist
def test_moefied_gpt2_under_expert_parallelism():
    losses = run_distributed(_worker, 2, timeout=120)
    assert losses[0] == losses[1]
