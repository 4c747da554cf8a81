"""parallel/pipeline/paired_steps.py's pairs without processes: each half waits for its own input
and sends its output as it ends (a neighbour never waits for this rank's backward to get its
forward input), and the lowered order no longer sends what the halves send."""
from torch.distributed.pipelining import schedules as ts

from parallel.interleave import Baton
from parallel.pipeline import paired_steps


class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(f"{self.name} arrived")


class _Stage:
    """A middle stage (neither first nor last) on a rank of its own."""
    is_first = is_last = False

    def __init__(self, log, index=1):
        self.log, self.stage_index = log, index

    def forward_one_chunk(self, mb, args, kwargs, save_forward_output):
        self.log.append(f"F{mb}")
        return f"y{mb}"

    def backward_one_chunk(self, mb, loss, full_backward, last_backward):
        self.log.append(f"B{mb}")

    def get_fwd_send_ops(self, mb):
        return [f"send F{mb}"]

    def get_bwd_send_ops(self, mb):
        return [f"send B{mb}"]


class _Sched:
    def __init__(self, log, stage):
        self._stages, self._n_microbatches = [stage], 4
        self.fwd_recv_ops = {(1, 1): [_Work(log, "input of F1")]}
        self.bwd_recv_ops = {(1, 0): [_Work(log, "gradient of B0")]}
        self.backward_counter = {1: 0}

    def _maybe_compute_loss(self, stage, out, targets, mb):
        pass

    def _maybe_get_loss(self, stage, mb):
        return None


class _Ctx:
    def __init__(self, sched):
        self.schedule_ref, self.arg_mbs, self.kwarg_mbs, self.target_mbs = sched, [()] * 4, [{}] * 4, None


def test_each_half_waits_for_its_input_and_sends_as_it_ends(monkeypatch):
    log, sends = [], []

    def batch_p2p(ops, desc=None):
        log.extend(ops)
        return [f"work of {o}" for o in ops]
    monkeypatch.setattr(ts, "_batch_p2p", batch_p2p)
    monkeypatch.setattr(ts, "_wait_batch_p2p", lambda works: [w.wait() for w in works])
    sched = _Sched(log, _Stage(log))
    f = ts._Action(1, ts.FORWARD, 1)
    b = ts._Action(1, ts.FULL_BACKWARD, 0)
    paired_steps._run_pair(Baton(), ts._Action(-1, ts.OVERLAP_F_B, None, (f, b)), _Ctx(sched), sends)
    # F1's output leaves before B0 runs (or even has its gradient); the pair's own sends are
    # kept to be waited for at the end of the step
    assert log == ["input of F1 arrived", "F1", "send F1", "gradient of B0 arrived", "B0", "send B0"]
    assert sends == [["work of send F1"], ["work of send B0"]]
    assert not sched.fwd_recv_ops and not sched.bwd_recv_ops


def test_lowered_order_keeps_only_the_sends_no_half_makes():
    A = ts._Action
    pair = A(-1, ts.OVERLAP_F_B, None, (A(1, ts.FORWARD, 2), A(1, ts.FULL_BACKWARD, 0)))
    order = {1: [A(1, ts.RECV_F, 2), A(1, ts.RECV_B, 0), pair, A(1, ts.SEND_F, 2),
                 A(1, ts.SEND_B, 0), A(1, ts.FORWARD, 3), A(1, ts.SEND_F, 3), None]}
    paired_steps._drop_pair_sends(order)
    assert [str(a) for a in order[1] if a is not None] == \
        [str(a) for a in (A(1, ts.RECV_F, 2), A(1, ts.RECV_B, 0), pair, A(1, ts.FORWARD, 3),
                          A(1, ts.SEND_F, 3))]
