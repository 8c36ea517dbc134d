"""Hang detection: a rank that skips a collective ends the job within the timeout, every rank saying where it was."""

import threading
import time

import pytest
import torch

from trickles.comm import flight
from trickles.launch import launch
from trickles.topology import ParallelDims, distributed_session
from trickles.watchdog import HANG_EXIT, Watchdog

TIMEOUT = 3.0


def _skip_collective(behaviour: str) -> int:
    """Rank 0 all-reduces over dp; rank 1 skips it and then waits elsewhere or computes."""
    with distributed_session(ParallelDims(dp=2), "cpu", timeout_s=TIMEOUT) as topo:
        flight.step = 7
        if topo.rank == 0:
            topo.comm("dp").all_reduce(torch.ones(4))
        elif behaviour == "other collective":
            topo.comm("world").broadcast(torch.zeros(2), src=0)
        else:
            time.sleep(120)  # stuck in "computation"
    return 0


@pytest.mark.parametrize("behaviour", ["other collective", "computation"])
def test_a_skipped_collective_ends_the_job_with_every_rank_reporting(capfd, behaviour):
    start = time.monotonic()
    status = launch(_skip_collective, (behaviour,), 2)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert status == HANG_EXIT
    reports = [line for line in err.splitlines() if line.startswith("[trickles] hang: ")]
    assert len(reports) == 2, err
    rank0 = next(line for line in reports if "rank 0 (dp 0/2) at step 7" in line)
    assert "inside all_reduce on group 'dp' (2 ranks, (4,) float32)" in rank0
    rank1 = next(line for line in reports if "rank 1 (dp 1/2) at step 7" in line)
    if behaviour == "other collective":
        assert "inside broadcast on group 'world'" in rank1
    else:
        assert "not inside a communication call" in rank1 and "because rank 0" in rank1
    waited = [float(line.split(" for ")[1].split(" s")[0]) for line in reports if " for " in line]
    assert waited and all(TIMEOUT <= w < TIMEOUT + 3.0 for w in waited), reports
    assert took < 60, f"the job took {took:.0f} s to end"  # spawning two ranks and importing torch included


class _Store:
    def __init__(self):
        self.data = {}

    def set(self, k, v):
        self.data[k] = v.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, k):
        return self.data[k]


def test_watchdog_fires_past_the_limit_and_stops_the_other_ranks(capfd):
    store, exits = _Store(), []
    done = threading.Event()
    flight.step = None  # no training step in this process (an earlier test's trainer may have set one)

    def exit_fn(code):
        exits.append(code)
        done.set()

    dog = Watchdog(0.3, rank=0, where="dp 0/2", store=store, exit_fn=exit_fn).start()
    flight.begin("all_reduce on group 'dp' (2 ranks, (4,) float32)")
    try:
        assert done.wait(5)
    finally:
        flight.end()
        dog.stop()
    assert exits == [HANG_EXIT] and "rank 0 (dp 0/2)" in store.data[dog.key].decode()
    # a call with its own, longer limit (a wait for another rank's file work) is left alone
    quiet = []
    other = Watchdog(0.2, rank=1, store=_Store(), exit_fn=quiet.append).start()
    flight.begin("barrier on group 'world'", limit_s=60)
    time.sleep(0.6)
    flight.end()
    other.stop()
    assert quiet == []
    # another rank's report stops this one, wherever it is
    peer = Watchdog(0.5, rank=1, store=store, exit_fn=exit_fn)
    done.clear()
    peer.start()
    assert done.wait(5)
    peer.stop()
    assert "rank 1: not inside a communication call; stopping because rank 0 (dp 0/2)" in capfd.readouterr().err
