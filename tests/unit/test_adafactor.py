"""trainer.adafactor.Adafactor equals torch.optim.Adafactor on plain tensors (the sharded
case is checked against one process in tests/dist/test_zero_family.py and e2e).

Tolerance 1e-6 relative on the parameters after 5 steps: the same formulas, with the row and
column means taken as sums / size instead of norms squared / size (fp32 rounding only)."""
import torch

from optim.adafactor import Adafactor


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 5), (3, 4, 7), (9,)]  # a matrix, an expert bank [E, D, F], a vector
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt_cls, steps=5, **kw):
    params = _params()
    opt = opt_cls(params, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        opt.zero_grad()
    return params, opt


def test_matches_torch_adafactor():
    for kw in (dict(lr=1e-2), dict(lr=0.3, weight_decay=0.1), dict(lr=1e-2, maximize=True)):
        ours, o1 = _run(Adafactor, **kw)
        ref, o2 = _run(torch.optim.Adafactor, foreach=False, **kw)
        for a, b, start in zip(ours, ref, _params()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert (a - start).abs().max() > 1e-3  # it did move
        for pa, pb in zip(ours, ref):  # same state names and shapes: checkpoints move between them
            sa, sb = o1.state[pa], o2.state[pb]
            assert sorted(sa) == sorted(k for k in sb if sb[k] is not None), (sorted(sa), sorted(sb))
            for k in sa:
                torch.testing.assert_close(sa[k], sb[k], rtol=1e-6, atol=1e-9)


def test_factored_state_is_small():
    params, opt = _run(Adafactor, steps=1)
    matrix = params[0]
    st = opt.state[matrix]
    assert st["row_var"].shape == (6, 1) and st["col_var"].shape == (1, 5)


def test_set_step_size_moves_each_param_by_lr_times_the_clipped_update():
    """relative_step=False: alpha = lr. One step from zero state: V = g^2 (vector) so
    U = sign(g), RMS(U) = 1, and the vector moves by exactly lr per element."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Adafactor([p], lr=0.05, relative_step=False)
    p.grad = torch.tensor([1.0, -2.0, 3.0, -4.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.05, 0.05, -0.05, 0.05]))
    q = torch.nn.Parameter(torch.zeros(4))
    rel = Adafactor([q], lr=0.05)
    q.grad = p.grad.clone()
    rel.step()  # relative: alpha = max(1e-3, RMS(0)) * min(0.05, 1) = 5e-5
    torch.testing.assert_close(q.detach(), torch.tensor([-5e-5, 5e-5, -5e-5, 5e-5]))
