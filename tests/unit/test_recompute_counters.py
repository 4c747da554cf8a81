"""Activation checkpointing runs a forward again inside backward; the counters a forward adds
to must not count it twice, and what the forward used must be used again: the global_batch
balance window (its f enters the loss's gradient) and the router's pending load (the
aux-loss-free bias update). Two micro-batches, with and without torch.utils.checkpoint around
the layer, fp64: the same gradients, window and load, exactly."""
import torch
from torch.utils.checkpoint import checkpoint

from moe import MoELayer


def _run(recompute: bool):
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, 2, None, "swiglu", balance_loss="global_batch").double()
    layer.reset_balance_window()
    for mb in range(2):
        x = torch.randn(3, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(mb))

        def f(x):
            return layer(x).sum() + layer.aux_loss * 100
        (checkpoint(f, x, use_reentrant=False) if recompute else f(x)).backward()
    return ({n: p.grad.clone() for n, p in layer.named_parameters()},
            layer.balance.window.clone(), layer.router.pending_load.clone())


def test_recompute_counts_each_forward_once_and_reuses_its_window():
    grads, window, load = _run(False)
    grads_r, window_r, load_r = _run(True)
    assert torch.equal(window, window_r) and torch.equal(load, load_r)
    assert window[-1] == 2 * 3 * 8  # two micro-batches' tokens, once each
    for n in grads:
        assert torch.equal(grads[n], grads_r[n]), n
