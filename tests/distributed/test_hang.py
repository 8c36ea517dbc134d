"""Hang detection: a rank that skips a collective or a pipeline send ends the job, every rank saying where it was.

The hangs are deterministic (a rank that never makes the call); no test asserts how long anything took. Each rank
arms ``signal.alarm(SAFETY_S)`` as a safety net only: should the watchdog ever fail, the stuck ranks die of SIGALRM,
the job's status is not the hang status and the test fails instead of hanging.
"""

import os
import signal
import threading
import time

import pytest
import torch

from trickles.comm import flight
from trickles.launch import launch
from trickles.topology import ParallelDims, distributed_session
from trickles.watchdog import _REPORTED, HANG_EXIT, Watchdog

TIMEOUT = 3.0
SAFETY_S = 240  # never reached when the watchdog works


def _skip_collective(behaviour: str) -> int:
    """Rank 0 all-reduces over dp; rank 1 skips it and then waits elsewhere or computes."""
    signal.alarm(SAFETY_S)
    with distributed_session(ParallelDims(dp=2), "cpu", timeout_s=TIMEOUT) as topo:
        flight.step = 7
        if topo.rank == 0:
            topo.comm("dp").all_reduce(torch.ones(4))
        elif behaviour == "other collective":
            topo.comm("world").broadcast(torch.zeros(2), src=0)
        else:
            threading.Event().wait()  # stuck in "computation" (until the watchdog, or the safety alarm)
    return 0


def _reports(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[trickles] hang: ")]


def _check_fired(reports: list[str], limit: float) -> None:
    """At least one rank found its own call past the limit (and says by how much); the others stopped because of it."""
    fired = [line for line in reports if f"more than the {limit:g} s allowed (parallel.timeout_s); stopping" in line]
    assert fired, reports
    for line in fired:  # the watchdog fires only past the limit: an invariant of its logic, not a timing
        assert float(line.split(" for ")[1].split(" s")[0]) >= limit, line  # printed to 0.1 s
    for line in reports:
        assert line in fired or "; stopping because rank " in line, line


@pytest.mark.parametrize("behaviour", ["other collective", "computation"])
def test_a_skipped_collective_ends_the_job_with_every_rank_reporting(capfd, behaviour):
    status = launch(_skip_collective, (behaviour,), 2)
    err = capfd.readouterr().err
    assert status == HANG_EXIT, err
    reports = _reports(err)
    assert len(reports) == 2, err
    rank0 = next(line for line in reports if "rank 0 (dp 0/2) at step 7" in line)
    assert "inside all_reduce on group 'dp' (2 ranks, (4,) float32)" in rank0
    rank1 = next(line for line in reports if "rank 1 (dp 1/2) at step 7" in line)
    if behaviour == "other collective":
        assert "inside broadcast on group 'world'" in rank1
    else:  # never inside a call, so it cannot have fired itself: it stopped because of rank 0's report
        assert "not inside a communication call; stopping because rank 0 (dp 0/2) at step 7" in rank1
    _check_fired(reports, TIMEOUT)
    assert "[trickles] a communication call was stuck past parallel.timeout_s (rank " in err


PIPE_TIMEOUT = 5.0


def _pipeline_skips_a_send(tmp: str) -> int:
    """Two pipeline stages train a tiny model with 1F1B; in step 2 stage 0 never sends the last micro-batch's
    activation."""
    from helpers import tiny_config

    from trickles.parallel.pipeline.runner import PipelineRunner
    from trickles.train.run import run_training

    signal.alarm(SAFETY_S)
    cfg = tiny_config(
        tmp,
        "parallel.pp=2",
        "parallel.schedule=1f1b",
        "train.micro_batch=2",
        f"parallel.timeout_s={PIPE_TIMEOUT}",
        steps=3,
    )
    if os.environ["RANK"] == "0":
        post = PipelineRunner._post

        def skipping(self, run, micro):
            if flight.step == 2:
                run = [a for a in run if not (a.kind == "SEND_F" and a.micro == 3)]  # the last of 4
            return post(self, run, micro)

        PipelineRunner._post = skipping
    run_training(cfg, quiet=True)
    return 0


def test_a_skipped_pipeline_send_ends_the_job_with_both_stages_naming_their_receive(capfd, tmp_path):
    """The pipeline's batched sends and receives are waited for under the watchdog: stage 1 waits for the activation
    that never comes, stage 0 (which went on) for the gradient of that micro-batch; both say so, and the job ends
    with the hang status."""
    status = launch(_pipeline_skips_a_send, (str(tmp_path),), 2)
    err = capfd.readouterr().err
    assert status == HANG_EXIT, err
    reports = _reports(err)
    assert len(reports) == 2, err
    stage1 = next(line for line in reports if "rank 1 (pp 1/2) at step 2: " in line)
    assert "inside recv on group 'pp' with rank 0 ((2, 32, 64))" in stage1, stage1
    stage0 = next(line for line in reports if "rank 0 (pp 0/2) at step 2: " in line)
    assert "inside recv on group 'pp_grad' with rank 1 ((2, 32, 64))" in stage0, stage0
    _check_fired(reports, PIPE_TIMEOUT)
    assert not any("at step 1" in line or "at step 3" in line for line in reports)


class _Store:
    def __init__(self):
        self.data = {}
        self.lock = threading.Lock()

    def set(self, k, v):
        self.data[k] = v.encode()

    def add(self, k, n):
        with self.lock:
            value = int(self.data.get(k, b"0")) + n
            self.data[k] = str(value).encode()
            return value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, k):
        return self.data[k]


LIMIT = 600.0  # a watchdog's limit in the tests below: far beyond anything the test's own pace could reach


def test_watchdog_fires_past_the_limit_and_stops_the_other_ranks(capfd):
    """Driven look by look (``check``), with the call's start moved into the past rather than waited for."""
    store, exits = _Store(), []
    flight.step = None  # no training step in this process (an earlier test's trainer may have set one)
    dog = Watchdog(LIMIT, rank=0, where="dp 0/2", store=store, exit_fn=exits.append)
    assert not dog.check() and exits == []  # not inside a call, nobody reported
    flight.begin("all_reduce on group 'dp' (2 ranks, (4,) float32)")
    try:
        assert not dog.check() and exits == []  # inside one, within the limit
        flight.since -= LIMIT + 1  # as if the call had been waiting for 601 s
        assert dog.check() and exits == [HANG_EXIT]
    finally:
        flight.end()
    report = store.data[dog.key].decode()
    assert report.startswith("rank 0 (dp 0/2): inside all_reduce on group 'dp' (2 ranks, (4,) float32) (call #"), report
    assert "more than the 600 s allowed (parallel.timeout_s); stopping" in capfd.readouterr().err

    # a call with its own, longer limit (a wait for another rank's file work) is judged by that limit
    quiet, other_store = [], _Store()
    other = Watchdog(LIMIT, rank=1, store=other_store, exit_fn=quiet.append)
    flight.begin("barrier on group 'world'", limit_s=3 * LIMIT)
    try:
        flight.since -= 2 * LIMIT  # past the watchdog's limit, within the call's own
        assert not other.check() and quiet == []
        flight.since -= 2 * LIMIT
        assert other.check() and quiet == [HANG_EXIT]
    finally:
        flight.end()
    assert "more than the 1800 s allowed" in capfd.readouterr().err

    # another rank's report stops this one, wherever it is
    stopped = []
    peer = Watchdog(LIMIT, rank=1, store=store, exit_fn=stopped.append)
    assert peer.check() and stopped == [HANG_EXIT]
    assert "rank 1: not inside a communication call; stopping because rank 0 (dp 0/2)" in capfd.readouterr().err


def test_watchdog_thread_looks_by_itself():
    """``start()`` runs the looks on a thread: a call past a short limit is reported without anyone calling check."""
    store, done, exits = _Store(), threading.Event(), []

    def exit_fn(code):
        exits.append(code)
        done.set()

    flight.step = None
    dog = Watchdog(0.3, rank=0, store=store, exit_fn=exit_fn)
    flight.begin("all_reduce on group 'dp' (2 ranks, (4,) float32)")
    try:
        dog.start()
        assert done.wait(120), "the watchdog thread never fired"  # safety net only; it fires after about 0.3 s
    finally:
        flight.end()
        dog.stop()
    assert exits == [HANG_EXIT] and dog.key in store.data


def test_a_rank_that_reported_exits_only_after_the_others_reported():
    """Leaving at once would close this rank's connections and end a peer's receive with an error before that peer
    said where it was; so the reporting rank waits for every rank's report (counted in the store) before it exits."""
    store, events = _Store(), []
    flight.step = None
    dog = Watchdog(LIMIT, rank=0, store=store, exit_fn=lambda code: events.append(("exit", code)), world=2)

    def peer():  # the other rank: reports once it has seen this rank's report
        while _REPORTED not in store.data:
            time.sleep(0.01)
        events.append(("peer reported", None))
        store.add(_REPORTED, 1)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    flight.begin("recv on group 'pp' with rank 1 ((2, 32, 64))")
    try:
        flight.since -= LIMIT + 1
        assert dog.check()
    finally:
        flight.end()
    thread.join(60)
    assert events == [("peer reported", None), ("exit", HANG_EXIT)]
    assert store.data[_REPORTED] == b"2"
