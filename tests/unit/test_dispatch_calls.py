"""The expert all-to-all's calls have one source: FLAT_CALLS (moe/ep_dispatcher.py) and
HIERARCHICAL_CALLS (moe/hierarchical.py) list every all_to_all_single a dispatch and its
combine issue, and the planner prices those tables (parallel/planner/expert_nodes.py
expert_a2a_bytes, comm.py a2a_calls).

The real dispatchers run here in one process: P = 4 ranks as threads on 2 nodes of 2, with
torch.distributed's all_to_all_single replaced by an in-memory exchange that records each
call (forward or backward, whether a peer is on another node, the bytes the rank hands over).
Each rank's calls must be its table's, sized by its own counts; the planner's calls per reach
must be each rank's, and its bytes, summed over the ranks, the recorded ones (the planner
takes a proxy's load as its own, A1 = A and U1 = U: exact in the sum over the group).
"""
import threading
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import moe.all_to_all as a2a_module
import moe.ep_dispatcher as ep_module
from moe.ep_dispatcher import FLAT_CALLS, FLAT_GATE_CALLS, ExpertParallelDispatcher
from moe.hierarchical import HIERARCHICAL_CALLS, HIERARCHICAL_GATE_CALLS, HierarchicalDispatcher
from moe.nodes import ExpertNodes
from moe.routing import Routing, count_ids
from moe.wire import Wire, wire_row_bytes
from parallel.planner.comm import a2a_calls
from parallel.planner.expert_nodes import EpNodes, expert_a2a_bytes

P, E, K, T, D = 4, 8, 3, 6, 160   # D: one full fp8 tile and a short one
NODES = ExpertNodes((0, 0, 1, 1))
TABLES = {"flat": FLAT_CALLS, "hierarchical": HIERARCHICAL_CALLS,   # "+gates": moe.gates_in_experts
          "flat+gates": FLAT_GATE_CALLS, "hierarchical+gates": HIERARCHICAL_GATE_CALLS}
# rows out in fp8, back in fp32, gradients in bf16 both ways: d, c and b all differ
DISPATCH_WIRE, COMBINE_WIRE = Wire("fp8", torch.bfloat16), Wire(torch.float32, torch.bfloat16)
ROWS = dict(d=wire_row_bytes("fp8", D), c=wire_row_bytes(torch.float32, D),
            b=wire_row_bytes(torch.bfloat16, D))


class _Exchange:
    """all_to_all_single among P threads through a shared board, each call recorded."""

    def __init__(self):
        self.board, self.barrier, self.local = [None] * P, threading.Barrier(P, timeout=60), threading.local()
        self.calls = {r: [] for r in range(P)}

    def all_to_all_single(self, out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        r = self.local.rank
        in_splits = list(in_splits or [inp.shape[0] // P] * P)
        out_splits = list(out_splits or [out.shape[0] // P] * P)
        peers = [p for p in range(P) if in_splits[p] or out_splits[p]]
        leaves = any(NODES.node_of_rank[p] != NODES.node_of_rank[r] for p in peers)
        self.calls[r].append((self.local.phase, leaves, inp.numel() * inp.element_size()))
        self.board[r] = inp.split(in_splits)
        self.barrier.wait()
        out.copy_(torch.cat([self.board[s][r] for s in range(P)]))
        self.barrier.wait()
        return SimpleNamespace(wait=lambda: None) if async_op else None


NODE0_ONLY = {0: 4, 3: 2}   # rank: its first tokens that pick their experts on node 0 only


def _routing(rank: int) -> Routing:
    """Random top-K, but for NODE0_ONLY's tokens: the ranks differ, so a proxy's load is not
    its own (U1 != U, A1 != A) and a size named wrongly in a table shows."""
    g, few = torch.Generator().manual_seed(rank), NODE0_ONLY.get(rank, 0)
    ids_TK = torch.stack([torch.randperm(E // 2 if t < few else E, generator=g)[:K] for t in range(T)])
    gate_TK = torch.rand(T, K, generator=g, requires_grad=True)
    counts, zero = count_ids(ids_TK, E), torch.zeros(())
    return Routing(ids_TK.reshape(-1), gate_TK.reshape(-1), K, T, counts, counts, zero, zero)


def _one_rank(ex, rank: int, mode: str, sizes: dict) -> None:
    """Dispatch, a stand-in expert, combine and backward on `rank`; its counts into sizes."""
    ex.local.rank, ex.local.phase = rank, "forward"
    disp = ExpertParallelDispatcher(E, "ep") if mode.startswith("flat") else \
        HierarchicalDispatcher(E, "ep", 0, NODES)
    x_TD = torch.randn(T, D, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    x_ND, _, meta = disp.dispatch(x_TD, _routing(rank), DISPATCH_WIRE)
    if mode.endswith("+gates"):   # the stand-in expert applies the gates; the combine sums
        y_ND = 2 * x_ND * disp.gates(meta).unsqueeze(1)
        y_TD = disp.combine(y_ND, meta, torch.float32, COMBINE_WIRE, weighted=False)
    else:
        y_TD = disp.combine(2 * x_ND, meta, torch.float32, COMBINE_WIRE)
    ex.local.phase = "backward"
    (y_TD * torch.linspace(-1, 1, D)).sum().backward()
    mine = dict(P=P, E=E, A=T * K, N=sum(meta.recv_splits), **ROWS)   # dropless: A = T K
    if meta.hops is not None:
        mine.update(U=sum(meta.hops.send1), U1=sum(meta.hops.recv1), A1=len(meta.hops.fan_A1))
    sizes[rank] = mine


def _run(mode: str, monkeypatch) -> tuple:
    ex, sizes, errors = _Exchange(), {}, []
    monkeypatch.setattr(a2a_module, "dist", ex)   # moe/'s one door to torch.distributed
    monkeypatch.setattr(ep_module, "dist", SimpleNamespace(get_world_size=lambda g: P,
                                                           get_rank=lambda g: ex.local.rank))

    def worker(rank):
        try:
            _one_rank(ex, rank, mode, sizes)
        except BaseException as e:   # noqa: BLE001 (re-raised below, on the test's thread)
            errors.append(e)
            ex.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return ex.calls, sizes


@pytest.mark.parametrize("mode", list(TABLES))
def test_the_dispatchers_issue_their_tables_calls_and_the_planner_prices_them(mode, monkeypatch):
    calls, sizes = _run(mode, monkeypatch)
    table = TABLES[mode]
    group = sum(c.reach == "group" for c in table), sum(c.reach == "node" for c in table)
    assert a2a_calls(mode, 1) == group   # the planner's calls per reach are the table's
    for r in range(P):
        want = Counter((c.phase, c.reach == "group", c.nbytes(sizes[r])) for c in table)
        assert Counter(calls[r]) == want, (mode, r)   # the same calls, reach and bytes
    nodes, planned = EpNodes(ep=P, per=2, count=2), 0.0
    for r, s in sizes.items():
        nu = s.get("U", s["A"]) / T   # the rank's own unique rows per token
        planned += sum(expert_a2a_bytes(mode, T, s["A"], s["N"] / s["A"], nu, nodes, E,
                                        (s["d"], s["c"], s["b"]), 1))
    recorded = sum(nbytes for r in range(P) for _, _, nbytes in calls[r])
    assert planned == pytest.approx(recorded, rel=1e-12)
