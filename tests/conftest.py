"""Suite-wide fixtures and guards.

* Multi-rank tests share spawned rank pools (``trickles.testing``); they are shut down once,
  at the end of the session.
* A run in which no test passed is a failure, whatever pytest's own exit status says (an empty
  or all-skipped run must never look green).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py, for test modules and spawned ranks

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
