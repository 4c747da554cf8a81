"""The parameter-server architecture (Li et al., OSDI 2014) as a data-parallel layout:
parallel.ps_servers = S shards over the first S ranks, every rank a worker, push/pull over
torch.distributed.rpc, bulk-synchronous (ps_staleness = 0) or bounded-delay (> 0).
units.py: what is sharded; server.py: a shard and its consistency rule; client.py: the
worker's pull/push and start/stop."""
from .client import PSClient, default_init_method, start, stop

__all__ = ["PSClient", "start", "stop", "default_init_method"]
