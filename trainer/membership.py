"""Which nodes a run trains on, and what changed since it last trained.

Under torchrun with an elastic node range (`--nnodes 1:2`) a lost node makes the surviving
agents restart their workers at the smaller world, and a node that comes back makes every
agent stop its workers (SIGTERM: they save a checkpoint, trainer/stops.py) and start them again
at the larger world. Each start of a run gathers the nodes it runs on (one all_gather of a
short string per rank) and rank 0 compares them with the run dir's `nodes.json`, written by
the previous start: one line names the node(s) that left or joined, the old and new world
size and the step the run resumes from. A node is its host and its torchrun agent's pid
(`host:pid`): several agents on one host (tests) stay apart, and an agent started again is
a new member.

A layout error at a world size other than the one the run last trained at says so, with the
fix (trainer/run.py).
"""
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

FILE = "nodes.json"


@dataclass(frozen=True)
class Membership:
    world: int
    nodes: dict  # node id -> sorted global ranks on it

    def to_json(self, step: int) -> str:
        return json.dumps({"world": self.world, "step": step, "nodes": self.nodes}, indent=1)


def node_id() -> str:
    """This process's node: host and the pid of the torchrun agent that started it (the
    process's own pid without torchrun: one process is one node)."""
    agent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    return f"{socket.gethostname()}:{agent}"


def gather(ctx) -> Membership:
    """Every rank's node id, gathered on every rank (a collective: all ranks call it)."""
    ids = [node_id()]
    if ctx.distributed:
        ids = [None] * ctx.world_size
        dist.all_gather_object(ids, node_id())
    nodes = {}
    for rank, node in enumerate(ids):
        nodes.setdefault(node, []).append(rank)
    return Membership(len(ids), nodes)


def read(run_dir) -> Membership | None:
    """The membership the run last trained with, or None (a new run, or one from before)."""
    path = Path(run_dir) / FILE
    try:
        data = json.loads(path.read_text())
        return Membership(int(data["world"]), dict(data["nodes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(run_dir, now: Membership, step: int) -> None:
    """Replace nodes.json whole (a temporary file renamed over it)."""
    path = Path(run_dir) / FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(now.to_json(step))
    os.replace(tmp, path)


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "rank" + ("s " if len(ranks) > 1 else " ") + ",".join(map(str, ranks))


def change_line(before: Membership | None, now: Membership, step: int) -> str | None:
    """The one line for a change of nodes between two starts of a run, or None (no change,
    or no earlier start)."""
    if before is None or set(before.nodes) == set(now.nodes):
        return None
    left = [f"{n} (was {_ranks(r)})" for n, r in sorted(before.nodes.items()) if n not in now.nodes]
    joined = [f"{n} (now {_ranks(r)})" for n, r in sorted(now.nodes.items()) if n not in before.nodes]
    parts = ([f"node{'s' if len(left) > 1 else ''} {', '.join(left)} left"] if left else []) + \
            ([f"node{'s' if len(joined) > 1 else ''} {', '.join(joined)} joined"] if joined else [])
    where = f"resuming from step {step}" if step else "starting from step 0 (no checkpoint)"
    return (f"nodes changed: {'; '.join(parts)}; world {before.world} -> {now.world} "
            f"processes on {len(now.nodes)} node(s); {where}")


def explain_layout_error(message: str, before: Membership | None, world: int) -> str:
    """A layout error, with the world change that caused it when the run last trained at
    another world size (an elastic job that lost or regained a node)."""
    if before is None or before.world == world:
        return message
    return (f"{message} [this run last trained on {before.world} processes and now has {world}: "
            f"an elastic job that lost or regained a node needs a layout valid at both sizes, "
            f"e.g. parallel.dp=-1 with ep, tp, pp and cp dividing each]")


def shared_store_warning() -> str | None:
    """torchrun's c10d rendezvous shares its store with the workers by default. Measured
    here (torch 2.13, two agents on one machine): a node killed and started again never
    finished the next rendezvous -- both agents waited with no workers -- while with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per round) it joined in seconds.
    Restarts under the shared store are upstream's known problem (pytorch#135712)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) < 2:
        return None
    return ("note: torchrun shares its rendezvous store with the workers here; a node that "
            "leaves this job cannot join it again (pytorch#135712). For an elastic multi-node "
            "run (--nnodes MIN:MAX) set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node")
