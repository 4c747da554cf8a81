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
"""
from dataclasses import dataclass

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


def _argmax(load: list) -> int:
    return max(range(len(load)), key=lambda p: (load[p], -p))   # ties: lowest rank


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
    counts = [int(c) for c in counts_E]
    E = len(counts)
    if P < 1 or E % P:
        raise ValueError(f"num_experts={E} must be divisible by the expert-parallel size {P}")
    if R < 0:
        raise ValueError(f"replica_slots={R} must be >= 0")
    L = E // P
    pieces = [[[e // L, counts[e]]] for e in range(E)]
    load = [sum(counts[p * L:(p + 1) * L]) for p in range(P)]
    owner_rows = tuple(load)
    replicas = [[] for _ in range(P)]
    total = sum(load)
    for _ in range(P * R):
        free = [p for p in range(P) if len(replicas[p]) < R]
        if not free:
            break
        h, c = _argmax(load), min(free, key=lambda p: (load[p], p))
        if load[h] - load[c] < 2:
            break
        cands = [e for e in range(h * L, (h + 1) * L) if e not in replicas[c] and pieces[e][0][1] > 0]
        if not cands:
            break
        e = max(cands, key=lambda e: (pieces[e][0][1], -e))
        deficit = (total - P * load[c]) // P
        m = max(1, min(pieces[e][0][1], deficit))
        pieces[e][0][1] -= m
        pieces[e].append([c, m])
        replicas[c].append(e)
        load[h] -= m
        load[c] += m
    pieces = tuple((tuple(p[0]),) + tuple(sorted(tuple(q) for q in p[1:])) for p in pieces)
    return Placement(L, R, tuple(tuple(sorted(r)) for r in replicas), pieces, owner_rows)


@dataclass(frozen=True)
class Routes:
    table_PPW: torch.Tensor   # long [source, destination, slot]: rows sent
    runs: tuple               # per source: ((g, n), ...) in expert order, then copy order


def route_rows(placement: Placement, counts_PE) -> Routes:
    """Which rows of each (source, expert) go to which copy.

    Expert e's rows are taken in a canonical order, source 0's first (in the order that
    source sorted them), then source 1's, ...; the copies take consecutive chunks of that
    order, owner first, each as many rows as `placement.pieces[e]` gives it. Source s then
    sends its rows of e, in its own order, as runs of (global slot, rows).
    """
    P, L, R = placement.world, placement.num_local, placement.replica_slots
    W = L + R
    counts = [[int(c) for c in row] for row in counts_PE]
    table = [[0] * (P * W) for _ in range(P)]   # Python ints: one tensor at the end
    runs = [[] for _ in range(P)]
    for e, copies in enumerate(placement.pieces):
        column = [counts[s][e] for s in range(P)]
        if sum(n for _, n in copies) != sum(column):
            raise ValueError(f"placement of expert {e} does not match the counts it is routed with")
        if len(copies) == 1:   # not replicated: every source's rows go to the owner
            g = copies[0][0] * W + placement.slot(e, copies[0][0])
            for s in range(P):
                if column[s]:
                    table[s][g] += column[s]
                    runs[s].append((g, column[s]))
            continue
        bounds, lo = [], 0
        for rank, n in copies:
            bounds.append((lo, lo + n, rank * W + placement.slot(e, rank)))
            lo += n
        start = 0
        for s in range(P):
            end = start + column[s]
            for b0, b1, g in bounds:
                n = min(end, b1) - max(start, b0)
                if n > 0:
                    table[s][g] += n
                    runs[s].append((g, n))
            start = end
    table_PPW = torch.tensor(table, dtype=torch.long).view(P, P, W)
    return Routes(table_PPW, tuple(tuple(r) for r in runs))
