"""Muon (MuonAdamW: Muon for the hidden matrices and expert banks, AdamW for the rest) under
layouts that hold pieces of matrices (ZeRO-1/2 slices, ZeRO-3 shards, 1-D tensor-parallel
blocks, ZeRO-1 slices and ZeRO-3 (strided) shards of those blocks, the 2-D grid's blocks at
tp=4 and the 2.5-D grid's at tp=8 (two stacked 2 x 2 grids holding copies), expert-tensor-
parallel d_ff blocks, alone and cut again by ZeRO-3 shards; host-resident
slices and shards under offload, ZeRO++ hpZ; ZeRO-1 slices over a group of one: flat, yet
whole) and under
pp2 (whole matrices per stage, the tied head on the last stage) and one world-8 composition
(dp2 x tp2 x pp2 x ep2), against one process: the same tiny MoE GPT, weights and global
batch, 5 steps (tests/dist/dense_common.py), Newton-Schulz in fp32.

Each matrix's update is orthogonalised whole by its owner rank (parallel/muon.py), so a layout
differs from one process only in the reduction order of the gradients. Checked per step: the
loss and the gradient norm (2e-5 absolute + 1e-4 relative, the layout matrix's tolerance) and
every parameter after the step against the one-process parameter (this rank's expert block
under expert parallelism; 1e-5 absolute + 1e-4 relative of its largest value: the Newton-Schulz
iterations pass the ~1e-7 differences of the reduced gradients on, a little amplified). The
ledger books the exchange as `muon_orthogonalise`: two all_to_alls per group and step, the
first handing over the rank's pieces padded to the largest piece of each matrix (none for a
copy), the second the owner's results (bytes checked against that formula), and nothing else
of the step changes kind.
"""
import pytest
import torch

from optim.build import muon_groups
from optim.muon import MuonAdamW
from tests.dist import dense_common as dc
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist
ATOL, RTOL, P_ATOL, P_RTOL = 2e-5, 1e-4, 1e-5, 1e-4
TIED = {"lm_head.weight": "tok_emb.weight"}  # one tensor in one process, one per end stage under pp
LAYOUTS = {2: [("dp2 zero1", {"dp": 2, "zero": 1}), ("dp2 zero2", {"dp": 2, "zero": 2}),
               ("dp2 zero3", {"dp": 2, "zero": 3}), ("tp2", {"dp": 1, "tp": 2}),
               ("pp2", {"dp": 1, "pp": 2, "microbatches": 2}),
               ("dp2 zero2 offload=optimizer", {"dp": 2, "zero": 2, "offload": "optimizer"}),
               ("dp2 zero3 offload=optimizer", {"dp": 2, "zero": 3, "offload": "optimizer"}),
               ("dp2 zero3 offload=params", {"dp": 2, "zero": 3, "offload": "params"}),
               ("dp2 ep2 zero1", {"dp": 2, "ep": 2, "zero": 1})],  # experts: slices of one rank
           4: [("dp4 ep2 zero3 hpz2", {"dp": 4, "ep": 2, "zero": 3, "zeropp_hpz": 2}),
               ("dp4 ep2 etp2", {"dp": 4, "ep": 2, "etp": 2}),
               ("tp4 2d", {"dp": 1, "tp": 4, "tp_mode": "2d"}),
               ("dp2 tp2 zero1", {"dp": 2, "tp": 2, "zero": 1}),
               ("dp2 tp2 zero3", {"dp": 2, "tp": 2, "zero": 3}),
               ("dp4 etp2 zero3", {"dp": 4, "etp": 2, "zero": 3})],
           8: [("dp2 tp2 pp2 ep2 zero0", {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "microbatches": 2}),
               ("tp8 2.5d", {"dp": 1, "tp": 8, "tp_mode": "2.5d", "tp_depth": 2})]}


def muon(model):
    return MuonAdamW(muon_groups(model, 0.1), dc.LR, ns_dtype="fp32")


def _reference(model_cfg, moe_cfg):
    """[(loss, grad_norm)] and {name: parameter} after each step, one process."""
    model = dc.make_model(model_cfg, moe_cfg)
    opt = muon(model)
    out, params = [], []
    for step in range(dc.STEPS):
        x, y = dc.batch(step, model_cfg.vocab_size)
        loss = dc.task_loss(model(x), y) + dc.collect_aux_loss(model)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), dc.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((loss.item(), norm.item()))
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out, params


CHECK_BYTES = 32  # parallel/muon.py check_same_matrices: an all-reduce of 4 int64


def _expected_bytes(opt) -> int:
    """Two all_to_alls per group and step: this rank hands over its padded piece of each matrix
    it is a source of (copies send nothing), and as owner every rank's piece of its matrices."""
    import torch.distributed as dist
    from parallel.muon import owners
    by_group = {}
    for d in opt.orthogonaliser.pieces.values():
        if d.size > 1:  # groups of one: orthogonalised in place
            by_group.setdefault(d.group.group_name, []).append(d)
    total = 0
    for pieces in by_group.values():
        me, own = dist.get_rank(pieces[0].group), owners([d.shape for d in pieces], pieces[0].size)
        for d, o in zip(pieces, own):
            total += max(d.numels()) * (d.sources()[me] + (d.size if o == me else 0))
    return 4 * total + CHECK_BYTES * len(by_group)  # + the agreement check, once per group


def _worker(rank, world):
    model_cfg, moe_cfg = dc.configs()
    ref, ref_params = _reference(model_cfg, moe_cfg)
    out = {}
    for name, spec in LAYOUTS[world]:
        seen = []

        def inspect(par, opt, step, comm):
            diffs = []
            for n, p in par.model.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                ref_name = TIED.get(n, n) if n not in ref_params[step] else n  # pp: the last
                want = dc.my_block(n, ref_params[step][ref_name], par.meshes, par.plan)  # stage's head
                diffs.append((n, (full.detach() - want).abs().max().item(),
                              P_ATOL + P_RTOL * want.abs().max().item()))
            seen.append((diffs, comm, _expected_bytes(opt), len(opt.orthogonaliser.pieces)))
        losses = dc.train_layout(world, spec, model_cfg, moe_cfg, inspect=inspect, make_optimizer=muon)
        out[name] = (losses, seen)
    return ref, out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_muon_layouts_equal_one_process(world):
    results = run_distributed(_worker, world, timeout=360)
    for rank, (ref, out) in enumerate(results):
        for name, (losses, seen) in out.items():
            for step, ((l, g), (rl, rg)) in enumerate(zip(losses, ref)):
                assert abs(l - rl) <= ATOL + RTOL * abs(rl), f"{name} step {step}: loss {l} vs {rl}"
                assert abs(g - rg) <= ATOL + RTOL * abs(rg), f"{name} step {step}: norm {g} vs {rg}"
            for step, (diffs, comm, want_bytes, n_pieces) in enumerate(seen):
                bad = [(n, f"{d:.2e} > {b:.2e}") for n, d, b in diffs if d > b]
                assert not bad, f"{name} rank {rank} step {step}: parameters differ: {bad}"
                assert n_pieces > 0 or name == "pp2", f"{name}: no matrix is held in pieces"
                assert comm.get("muon_orthogonalise", 0) == want_bytes, (name, comm, want_bytes)


def _disagree(rank, world):
    """Each rank's outcome of check_same_matrices: the same lists, then lists that differ."""
    import torch.distributed as dist
    from parallel.muon import check_same_matrices
    group = dist.group.WORLD
    check_same_matrices([(4, 8), (8, 8)], group)          # agree: returns
    try:
        check_same_matrices([(4, 8), (8, 8)][:1 + rank], group)
    except ValueError as e:
        return str(e)
    return None


def test_ranks_that_step_different_matrices_get_one_line_not_a_hang():
    """The exchange's all_to_alls are sized from each rank's own list of matrices with
    gradients: a rank that disagrees is named before any of them (one all-reduce)."""
    for msg in run_distributed(_disagree, 2, timeout=60):
        assert msg is not None and msg.startswith("train.optimizer=muon: the ranks of one exchange "
                                                  "group step different matrices (between 1 and 2"), msg
