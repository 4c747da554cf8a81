"""Hot-expert replication: which rank serves which rows of each expert (pure arithmetic).

Shapes: P ranks of the expert-parallel group (they are also the P token sources), E experts,
L = E/P experts owned per rank (rank r owns [r*L, (r+1)*L)), R replica slots per rank,
W = L + R expert slots per rank; a global slot id is g = rank * W + slot.

`plan_placement(counts_E, P, R)` decides, from this step's global rows per expert, which
hot experts get a replica on which cold rank and how many of their rows each copy serves;
`route_rows(placement, counts_PE)` turns that into the exact rows each source sends to each
slot. Both are deterministic functions of integer counts (ties go to the lower rank or expert
id), so every rank that holds the same counts computes the same table with no further
communication. With R = 0 the result is plain expert parallelism: g = e for every expert.

Host arithmetic on numpy arrays, vectorised over ranks and experts: the only Python loops run
over the replica moves (at most P*R) and the replicated experts, never over ranks x experts,
so a plan at 64 ranks x 256 experts costs well under a millisecond of host time per layer.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["Placement", "plan_placement", "route_rows", "Routes"]


@dataclass(frozen=True)
class Placement:
    num_local: int        # L: experts owned per rank
    replica_slots: int    # R: replica slots per rank (some may stay empty)
    replicas: tuple       # per rank: the expert ids in its replica slots, ascending
    pieces: tuple         # per expert: ((rank, rows), ...), owner first, then replicas by rank
    owner_rows: tuple     # per rank: rows of the experts it owns (load without replication)

    @property
    def world(self) -> int:
        return len(self.replicas)

    @property
    def rank_rows(self) -> tuple:
        """Rows each rank serves with this placement."""
        rows = [0] * self.world
        for pieces in self.pieces:
            for rank, n in pieces:
                rows[rank] += n
        return tuple(rows)

    def slot(self, expert: int, rank: int) -> int:
        """Local slot of `expert` on `rank`: its owned index, or L + its replica index."""
        L = self.num_local
        if expert // L == rank:
            return expert - rank * L
        return L + self.replicas[rank].index(expert)


def plan_placement(counts_E, P: int, R: int) -> Placement:
    """Place up to R replicas per rank so the rows per rank approach the mean.

    Greedy, at most P*R moves: take the most-loaded rank h and the least-loaded rank c that
    still has a free slot; stop when they differ by less than 2 rows. Otherwise h's owned
    expert with the most rows it still serves (not already replicated on c) gets a replica
    on c, which takes m = min(its rows on h, c's deficit under the mean) rows (at least 1).
    c never goes above the mean (rounded up), so the maximum never grows. h may drop below
    the mean: it then fills its own free slot from another hot rank later, which is what
    balances two hot ranks with one slot per rank (see tests/unit/test_placement.py).
    """
    counts = np.asarray(counts_E, dtype=np.int64).reshape(-1)
    E = counts.size
    if P < 1 or E % P:
        raise ValueError(f"num_experts={E} must be divisible by the expert-parallel size {P}")
    if R < 0:
        raise ValueError(f"replica_slots={R} must be >= 0")
    L = E // P
    load = counts.reshape(P, L).sum(1)
    owner_rows = tuple(load.tolist())
    if R == 0:
        return Placement(L, 0, ((),) * P, tuple(((e // L, int(n)),) for e, n in enumerate(counts.tolist())),
                         owner_rows)
    own_left = counts.copy()              # rows each expert's owner still serves
    moved = {}                            # expert -> [(rank, rows), ...] of its replicas
    replicas = [[] for _ in range(P)]
    held_PE = np.zeros((P, E), dtype=bool)  # rank p holds a replica of expert e
    free_P = np.full(P, R, dtype=np.int64)  # free replica slots per rank
    total = int(load.sum())
    for _ in range(P * R):
        if not free_P.any():
            break
        h = int(np.argmax(load))                                        # ties: lowest rank
        c = int(np.argmin(np.where(free_P > 0, load, np.iinfo(np.int64).max)))
        if load[h] - load[c] < 2:
            break
        left_L = np.where(held_PE[c, h * L:(h + 1) * L], 0, own_left[h * L:(h + 1) * L])
        if not left_L.any():
            break
        e = h * L + int(np.argmax(left_L))                              # ties: lowest id
        deficit = (total - P * int(load[c])) // P
        m = max(1, min(int(own_left[e]), deficit))
        own_left[e] -= m
        moved.setdefault(e, []).append((c, m))
        replicas[c].append(e)
        held_PE[c, e], free_P[c] = True, free_P[c] - 1
        load[h] -= m
        load[c] += m
    pieces = tuple(((e // L, int(own_left[e])),) + tuple(sorted(moved.get(e, ())))
                   for e in range(E))
    return Placement(L, R, tuple(tuple(sorted(r)) for r in replicas), pieces, owner_rows)


@dataclass(frozen=True)
class Routes:
    table: np.ndarray         # int64 [source, destination * W + slot]: rows sent
    world: int
    slots: int                # W
    replicated: dict = field(default_factory=dict)  # expert -> (global slots [c], rows [P, c])
    owner_slot_E: np.ndarray = None  # global slot of each expert's owned copy

    @property
    def table_PPW(self) -> torch.Tensor:
        """long [source, destination, slot]: rows sent (a torch view of `table`)."""
        return torch.from_numpy(self.table).view(self.world, self.world, self.slots)

    def runs_of(self, s: int) -> tuple:
        """((g, n), ...): the runs of rows source s sends, in expert order, then copy order."""
        counts = self.counts_PE[s]
        keys, gs, ns = [np.arange(counts.size) * (self.world + 1)], [self.owner_slot_E], [counts]
        plain = np.ones(counts.size, dtype=bool)
        for e, (g_c, n_Pc) in self.replicated.items():
            plain[e] = False
            keys.append(e * (self.world + 1) + 1 + np.arange(g_c.size))
            gs.append(g_c)
            ns.append(n_Pc[s])
        keys[0], gs[0], ns[0] = keys[0][plain], gs[0][plain], ns[0][plain]
        key, g, n = (np.concatenate(a) for a in (keys, gs, ns))
        order = np.argsort(key, kind="stable")
        g, n = g[order], n[order]
        return tuple(zip(g[n > 0].tolist(), n[n > 0].tolist()))

    @property
    def runs(self) -> tuple:
        """Per source: runs_of(source)."""
        return tuple(self.runs_of(s) for s in range(self.world))

    counts_PE: np.ndarray = None


def route_rows(placement: Placement, counts_PE) -> Routes:
    """Which rows of each (source, expert) go to which copy.

    Expert e's rows are taken in a canonical order, source 0's first (in the order that
    source sorted them), then source 1's, ...; the copies take consecutive chunks of that
    order, owner first, each as many rows as `placement.pieces[e]` gives it. Source s then
    sends its rows of e, in its own order, as runs of (global slot, rows) (`Routes.runs_of`).
    """
    P, L, R = placement.world, placement.num_local, placement.replica_slots
    W = L + R
    C = np.asarray(counts_PE, dtype=np.int64).reshape(P, -1)
    E = C.shape[1]
    experts = np.arange(E)
    owner_slot_E = (experts // L) * W + experts % L
    table = np.zeros((P, P * W), dtype=np.int64)
    replicated = {e: p for e, p in enumerate(placement.pieces) if len(p) > 1}
    plain = np.ones(E, dtype=bool)
    plain[list(replicated)] = False
    if not np.array_equal(C.sum(0)[plain], np.array([p[0][1] for p in placement.pieces])[plain]):
        raise ValueError("placement does not match the counts it is routed with")
    table[:, owner_slot_E[plain]] = C[:, plain]
    chunks = {}
    for e, copies in replicated.items():
        n_c = np.array([n for _, n in copies], dtype=np.int64)
        if n_c.sum() != C[:, e].sum():
            raise ValueError(f"placement of expert {e} does not match the counts it is routed with")
        g_c = np.array([rank * W + placement.slot(e, rank) for rank, _ in copies], dtype=np.int64)
        end_P = np.cumsum(C[:, e])
        start_P, b1 = end_P - C[:, e], np.cumsum(n_c)
        n_Pc = np.clip(np.minimum(end_P[:, None], b1[None]) - np.maximum(start_P[:, None], (b1 - n_c)[None]), 0, None)
        table[:, g_c] += n_Pc
        chunks[e] = (g_c, n_Pc)
    return Routes(table, P, W, chunks, owner_slot_E, C)
