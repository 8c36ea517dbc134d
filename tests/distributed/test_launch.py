"""The local launcher: clean success; a failing rank stops everyone with its traceback; a status a restart cannot
cure (bad input, failed saves) is not restarted; after SIGTERM the status is what the ranks did."""

import os
import signal
import sys
import threading
import time

import torch

from trickles.errors import EXIT_SAVES_FAILED, EXIT_TERM_UNSAVED, SavesFailed, Terminated, UserError
from trickles.launch import launch
from trickles.process import handle_sigterm, wait_for_stop_request
from trickles.topology import ParallelDims, distributed_session


def _train_like(path):
    with distributed_session(ParallelDims(dp=int(os.environ["WORLD_SIZE"]))) as topo:
        t = torch.ones(3) * (topo.rank + 1)
        topo.comm("dp").all_reduce(t)
        with open(os.path.join(path, f"rank{topo.rank}"), "w") as f:
            f.write(str(t.tolist()))


def _fail_on_rank_one(path):
    with distributed_session(ParallelDims(dp=int(os.environ["WORLD_SIZE"]))) as topo:
        with open(os.path.join(path, f"pid{topo.rank}"), "w") as f:
            f.write(str(os.getpid()))
        topo.comm("dp").all_reduce(torch.ones(2))  # both ranks are up and connected
        if topo.rank == 1:
            raise RuntimeError("rank one gave up")
        # rank 0 is blocked until the test releases it, which it does only if the launcher returned without
        # stopping it (or, as a safety net, after RELEASE_S): a rank that ever gets past here was waited for
        while not os.path.exists(os.path.join(path, "release")):
            time.sleep(0.05)
        with open(os.path.join(path, "rank0 released"), "w") as f:
            f.write("the launcher let the blocked rank run on")


def _user_error(path):
    open(os.path.join(path, f"attempt{os.environ['TRICKLES_RESTART']}"), "w").close()
    if int(os.environ["RANK"]) == 0:
        raise UserError("data.source 'nowhere.txt' matches no file")
    time.sleep(60)


def _saves_fail(path):
    open(os.path.join(path, f"attempt{os.environ['TRICKLES_RESTART']}"), "w").close()
    raise SavesFailed("3 checkpoint saves failed in a row (the last at step 6: OSError: No space left on device)")


def _sigterm(path):
    """Rank 0 stops as a trainer does when its checkpoint is verified; rank 1 ignores SIGTERM."""
    rank = int(os.environ["RANK"])
    with handle_sigterm():
        if rank == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(path, f"up{rank}"), "w").close()
        if rank == 0 and wait_for_stop_request(60):
            raise Terminated("SIGTERM: stopped after step 3, its checkpoint saved and verified")
        time.sleep(60)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is as good as gone
        return f.read().split()[2] != "Z"


def test_success_is_clean_every_time(tmp_path):
    for i in range(4):  # gloo teardown must not turn a good run red, ever
        d = tmp_path / str(i)
        d.mkdir()
        assert launch(_train_like, (str(d),), 2) == 0
        assert (d / "rank0").read_text() == (d / "rank1").read_text() == "[3.0, 3.0, 3.0]"


RELEASE_S = 300  # safety net only: a launcher that waits for the blocked rank returns after this, and the test fails


def test_failing_rank_stops_all_and_prints_traceback(tmp_path, capfd):
    safety = threading.Timer(RELEASE_S, (tmp_path / "release").touch)
    safety.start()
    try:
        status = launch(_fail_on_rank_one, (str(tmp_path),), 2)
    finally:
        safety.cancel()
    (tmp_path / "release").touch()  # a rank 0 still running now would run on and say so
    err = capfd.readouterr().err
    assert status == 1
    assert "rank 1 exited with status 1" in err and "RuntimeError: rank one gave up" in err
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not any(_alive(p) for p in pids), "no orphan ranks"
    assert not (tmp_path / "rank0 released").exists(), "the blocked rank must be killed, not waited for"


def test_user_error_in_a_rank_is_one_line_status_two_and_not_restarted(tmp_path, capfd):
    assert launch(_user_error, (str(tmp_path),), 2, max_restarts=2) == 2
    err = capfd.readouterr().err
    assert "error: data.source 'nowhere.txt' matches no file" in err
    assert "Traceback" not in err and "restarting all" not in err
    assert sorted(os.listdir(tmp_path)) == ["attempt0"]


def test_failed_saves_are_their_own_status_and_not_restarted(tmp_path, capfd):
    """A run whose saves kept failing would fail again (a full disk): status 5, one attempt, the reason said."""
    assert launch(_saves_fail, (str(tmp_path),), 2, max_restarts=2) == EXIT_SAVES_FAILED
    err = capfd.readouterr().err
    assert "error: 3 checkpoint saves failed in a row" in err
    assert "[trickles] not restarting: status 5 (checkpoint saves failed" in err and "restarting all" not in err
    assert sorted(os.listdir(tmp_path)) == ["attempt0"]


def test_after_sigterm_the_status_is_what_the_ranks_did(tmp_path, capfd, monkeypatch):
    """SIGTERM to the launcher: rank 0 stops with its checkpoint verified (143), rank 1 ignores it and is killed after
    the grace period -- so no checkpoint is confirmed: status 6, naming rank 1, never "saved"."""
    monkeypatch.setattr(sys.modules["trickles.launch"], "TERM_GRACE_S", 2.0)  # (trickles.launch: the function)

    def send_sigterm_when_up():
        deadline = time.monotonic() + RELEASE_S
        while not all((tmp_path / f"up{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # this process is the launcher

    sender = threading.Thread(target=send_sigterm_when_up, daemon=True)
    sender.start()
    status = launch(_sigterm, (str(tmp_path),), 2)
    sender.join()
    err = capfd.readouterr().err
    assert status == EXIT_TERM_UNSAVED, err
    assert "[trickles] SIGTERM: rank(s) 1 did not stop within 2 s and were killed" in err
    assert "saved a checkpoint" not in err


def _sleeper(folder):
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    return 0


def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    """SIGKILL to the launcher (no handler runs) ends its ranks too, within seconds (the lifeline pipe)."""
    import subprocess

    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from test_launch import _sleeper; "
        "from trickles.launch import launch; launch(_sleeper, (sys.argv[2],), 2)"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    launcher = subprocess.Popen([sys.executable, "-c", script, here, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, f"ranks {[p for p in pids if _alive(p)]} outlived their launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # (a zombie has ended)
        return f.read().split(")")[-1].split()[0] != "Z"
