"""The parameter server's stop agreement (parallel/data_parallel/param_server/server.py
ServerShard.stop_step): the first stop request a shard sees fixes the step every worker stops
after, never changed by later requests, and no worker can be running a later step then.
Driven here on one ServerShard without RPC (its entry points return futures)."""
import torch

from parallel.data_parallel.param_server.server import ServerShard
from parallel.data_parallel.param_server.units import make_units


def _shard(workers: int, staleness: int) -> ServerShard:
    model = torch.nn.Linear(4, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ServerShard(make_units(model), dict(model.named_parameters()), opt, workers, staleness)


def _push(shard, worker, step, stop=False):
    return shard.push(worker, step, {}, 0.1, torch.zeros(2), False, stop)


def _stop_at(fut):
    return int(fut.wait()[-1])


def test_bounded_staleness_stops_every_worker_after_the_same_step():
    s = 1
    shard = _shard(workers=2, staleness=s)
    assert _stop_at(_push(shard, 0, 1)) == -1                 # nobody asked yet
    _push(shard, 1, 1)
    assert _stop_at(_push(shard, 0, 2)) == -1
    # worker 1 got SIGTERM while at step 2: the decision is 2 + 1 + s = 4 ...
    assert _stop_at(_push(shard, 1, 2, stop=True)) == 4
    # ... and no worker can be past it: a pull of step 5 waits for every push of step 3
    assert not shard.pull(0, 5).done()
    # later requests (worker 0 got its SIGTERM later) change nothing
    assert _stop_at(_push(shard, 0, 3, stop=True)) == 4
    assert _stop_at(_push(shard, 1, 3)) == 4


def test_synchronous_workers_read_the_stop_in_the_same_reply():
    shard = _shard(workers=2, staleness=0)
    first = _push(shard, 0, 1, stop=True)
    assert not first.done()                                  # s = 0: answered once all pushed
    second = _push(shard, 1, 1)
    assert int(first.wait()[-1]) == int(second.wait()[-1]) == 1
