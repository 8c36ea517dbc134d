"""The checkpoint saver's way out after an error (trickles/train/saver.py): rank 0's background writer, waiting for a
rank that died mid-save, gives up at once when the run abandons the save, rather than after parallel.timeout_s (a
launcher restarting the job waits for this process to end)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from trickles.data import ByteTokenizer
from trickles.train.saver import Saver, Snapshot


def test_abandon_stops_waiting_for_a_rank_that_will_never_write(tmp_path):
    topo = SimpleNamespace(rank=0, world_size=2, is_main=True, comm=lambda name: SimpleNamespace(barrier=lambda: None))
    saver = Saver(topo, background=True, max_failed=3, timeout_s=300, say=print)
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    taken = []

    def take(tmp):
        os.makedirs(tmp, exist_ok=True)
        taken.append(tmp)
        return Snapshot(step=4, tmp=tmp, files={}, meta={"step": 4}, tokenizer=ByteTokenizer())

    assert saver.save(take, str(ckpt_dir), 4, wait=False) is None
    time.sleep(0.2)  # rank 0 has written its part and waits for rank 1's marker, which never comes
    assert saver._flight.thread.is_alive()
    began = time.monotonic()
    saver.abandon()
    assert time.monotonic() - began < 10  # not parallel.timeout_s (300 s)
    # nothing committed; the half-written checkpoint stays (rank 1 may still write into it) for the next save to remove
    assert os.listdir(ckpt_dir) == ["step_000004.tmp"]
