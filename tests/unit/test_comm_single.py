"""A group of one rank: every autograd-aware collective is the identity, both ways, and records nothing."""

import pytest
import torch

from trickles import comm as C
from trickles.comm.recorder import FlightRecorder


@pytest.mark.parametrize(
    "fn",
    [
        C.copy_to_region,
        C.reduce_from_region,
        C.scatter_to_region,
        C.gather_from_region,
        C.gather_sequence,
        C.reduce_scatter_sequence,
        lambda x, g: C.all_to_all(x, g, 1, 2),
    ],
    ids=[
        "copy_to",
        "reduce_from",
        "scatter_to",
        "gather_from",
        "gather_sequence",
        "reduce_scatter_sequence",
        "all_to_all",
    ],
)
def test_single_rank_collectives_are_the_identity(fn):
    ledger = C.CommLedger()
    group = C.GroupComm("solo", None, ledger)
    x = torch.randn(2, 4, 6, requires_grad=True)
    y = fn(x, group)
    assert isinstance(y, torch.Tensor) and torch.equal(y, x)
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert not ledger.stats


def test_ledger_totals_select_by_op_and_group():
    ledger = C.CommLedger()
    ledger.record("all_reduce", "dp", 100, 150.0)
    ledger.record("all_reduce", "dp", 20, 30.0)
    ledger.record("all_gather", "tp", 8, 4.0)
    assert ledger.calls() == 3 and ledger.calls("all_reduce") == 2 and ledger.calls(group="tp") == 1
    assert ledger.calls("all_gather", "dp") == 0
    assert ledger.bytes("all_reduce", "dp") == 120 and ledger.bytes(wire=True) == 184
    assert ledger.snapshot()["all_gather/tp"] == {"calls": 1, "bytes": 8, "wire_bytes": 4}
    ledger.enabled = False
    ledger.record("all_reduce", "dp", 1, 1.0)
    assert ledger.calls() == 3


class _Work:
    def __init__(self, completed: bool):
        self.completed = completed

    def is_completed(self) -> bool:
        return self.completed


def test_a_handle_is_done_when_its_work_is_or_when_it_has_none():
    assert C.Handle(None, "").done()
    assert C.Handle(_Work(True), "send").done()
    assert not C.Handle(_Work(False), "send").done()


def test_the_flight_recorder_tells_its_sink_each_call_and_its_end():
    """The rank pool's status line (the sink) names the call a rank is inside and is cleared when it returns; the
    time spent inside adds up; without a sink nothing is called."""
    seen: list = []
    recorder = FlightRecorder(sink=seen.append)
    recorder.begin("all_reduce on group 'dp'", limit_s=5.0)
    assert recorder.current == "all_reduce on group 'dp' (call #1)" and recorder.limit_s == 5.0
    recorder.end()
    assert seen == ["all_reduce on group 'dp' (call #1)", None]
    assert recorder.current is None and recorder.limit_s is None and recorder.blocked_s >= 0.0
    quiet = FlightRecorder()
    quiet.begin("barrier")
    quiet.end()  # no sink: no call
    assert quiet.seq == 1 and quiet.current is None
