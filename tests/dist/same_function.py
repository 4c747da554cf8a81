"""Shared pieces of the MoE same-function tests (test_replication.py, test_a2a_overlap.py):
a layer variant against the plain layer on the same ranks and inputs, compared as rows of
(case, metric, value, tolerance).

Shapes: B sequences per rank, S tokens per sequence; the tiny nets map 5 features to 3.
"""
import torch
import torch.nn as nn

REL, ABS = 1e-6, 1e-9


def scaled_err(a, b) -> float:
    """max |a-b| / (REL * max|b| + ABS): <= 1 means within tolerance."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / (REL * b.abs().max() + ABS)) if a.numel() else 0.0


def sgd_losses(net, rank: int, steps: int, B: int, S: int) -> list:
    """Losses of `steps` SGD steps (lr 0.1) of mse + the MoE aux loss on this rank's inputs."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, t = torch.randn(B, S, 5, generator=g), torch.randn(B, S, 3, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(net(x), t) + net.moe.aux_loss
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out


def check_rows(results, min_rows: int) -> None:
    """Every rank's rows within tolerance, and at least min_rows of them in all."""
    bad = [f"rank {r}: {case}: {metric} = {v:.3g} > {tol}"
           for r, rows in enumerate(results) for case, metric, v, tol in rows if v > tol]
    assert not bad, "\n".join(bad)
    assert sum(len(rows) for rows in results) > min_rows
