"""Suite-wide fixtures and guards.

* Multi-rank tests share spawned rank pools (``trickles.testing``); they are shut down once,
  at the end of the session. Under ``pytest -n 2`` (pytest-xdist; the README's command) every test in
  ``tests/distributed/`` runs on one worker, one after another (their ranks use both cores), while the other
  worker takes the one-process and end-to-end tests (:func:`pytest_xdist_make_scheduler`).
* A run in which no test passed is a failure, whatever pytest's own exit status says (an empty
  or all-skipped run must never look green).
* Under ``CI=true`` (set by ``.ci/run``) a skipped test is a failure: CI installs everything the
  suite needs (``bash install.sh test``), so a skip there means something broke (a dependency that
  no longer imports, a fixture that bailed out). Skips at collection (a module-level
  ``pytest.importorskip``) fail the collection. The one exception is a test marked
  ``@pytest.mark.needs_gpu``: it needs hardware CI does not have; it is skipped wherever CUDA is
  unavailable, and that skip stays a skip under CI. ``xfail`` is not a skip and is left alone.
  Outside CI every skip stays a skip.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py, for test modules and spawned ranks

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "TRITON_INTERPRET" not in os.environ:  # Triton kernels run in Triton's interpreter where there is no GPU; Triton
    import torch  # decides when a kernel is defined, so this must come before trickles.kernels is imported

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on a machine whose cores the other one's ranks are using:
    import torch  # one intra-op thread each for the tests that run in the worker itself (ranks set their own)

    torch.set_num_threads(1)

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
HARDWARE_MARKERS = ("needs_gpu",)  # skips CI tolerates: hardware the CI machine does not have


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


RANKS_DIR = "tests/distributed/"  # under pytest -n 2, these tests run one after another on one worker


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: it is only called where xdist is installed and -n is given
def pytest_xdist_make_scheduler(config, log):
    """Every multi-rank test in one unit of work (one worker, in collection order: their ranks use the cores); each
    other test a unit of its own, handed to whichever worker is free (xdist's ``load`` distribution)."""
    from xdist.scheduler import LoadScopeScheduling

    class RanksOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return RANKS_DIR if nodeid.startswith(RANKS_DIR) else nodeid

    return RanksOnOneWorker(config, log)


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("needs_gpu")]
    if gpu_tests:
        import torch

        if not torch.cuda.is_available():
            for item in gpu_tests:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device (marked needs_gpu)"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if (
        IN_CI
        and rep.skipped
        and not hasattr(rep, "wasxfail")
        and not any(item.get_closest_marker(m) for m in HARDWARE_MARKERS)
    ):
        rep.outcome = "failed"
        rep.longrepr = (
            f"skipped under CI=true ({_skip_reason(rep.longrepr)}): CI installs everything this test needs, "
            f"so the skip hides a failure; fix the cause, or mark the test needs_gpu if it needs hardware"
        )
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    if IN_CI and rep.skipped:
        rep.outcome = "failed"
        rep.longrepr = (
            f"{collector.nodeid} skipped at collection under CI=true ({_skip_reason(rep.longrepr)}); "
            f"CI installs everything the suite needs, so the skip hides a failure"
        )
    return rep


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    from trickles.testing import shutdown_pools

    shutdown_pools()


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter is not None else 0
    if passed == 0 and not session.config.option.collectonly:
        if reporter is not None:
            reporter.write_line("no test passed: treating this run as a failure", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
