"""``benchmarks/gpu_check.py`` without a GPU: the CPU smoke run of one step with every step in the JSON and the table,
the plan of a dry run, and a step that fails or runs out of time being recorded while the run goes on."""

import argparse
import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.append(BENCH)  # last: the benchmarks' module names shadow nothing of the suite's

import gpu_check  # noqa: E402

from trickles.testing import run_command  # noqa: E402

KEYS = [s.key for s in gpu_check.steps()]


def _run(out, *args):
    return run_command(
        [sys.executable, os.path.join(BENCH, "gpu_check.py"), "--device", "cpu", "--out", str(out), *args],
        text=True,
        timeout=120,
    )


def _written(out):
    doc = json.loads((out / "gpu_check.json").read_text())
    table = (out / "gpu_check.md").read_text()
    return doc, {s["key"]: s for s in doc["steps"]}, table


def test_the_cpu_smoke_run_of_one_step_records_every_step(tmp_path):
    r = _run(tmp_path, "--only", "k")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc, steps, table = _written(tmp_path)
    assert [s["key"] for s in doc["steps"]] == KEYS and len(KEYS) == 16
    assert doc["device"] == "cpu" and doc["environment"]["liger_kernel"]  # a version, or "absent"
    split = steps["k"]  # the zero-bubble split: exact, and its W restarts counted
    assert split["status"] == "ok" and split["seconds"] > 0 and "split_backward.py --json" in split["command"]
    assert split["numbers"]["agreement"] <= 1e-6 and split["numbers"]["restarts"] > 0
    assert all(steps[k]["status"] == "skipped: not selected (--only)" for k in KEYS if k != "k")
    for key in KEYS:  # one row per step in the table, and the table printed at the end
        assert f"| {key} | {steps[key]['title']} | {steps[key]['status']} |" in table
    assert "| step | what | status | s | result |" in r.stdout
    assert "===== k: exit 0" in (tmp_path / "gpu_check.log").read_text()


def test_a_dry_run_plans_every_step_and_runs_none(tmp_path):
    r = _run(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stderr[-3000:]
    _, steps, _ = _written(tmp_path)
    assert all(steps[k]["status"] == "planned" and steps[k]["seconds"] == 0 for k in KEYS)
    assert "-m needs_gpu" in steps["a2"]["command"]
    assert "tests/unit/test_streaming.py" in steps["a2"]["command"]  # found by reading tests/ for the mark


def test_a_step_that_fails_times_out_or_has_no_numbers_is_recorded(tmp_path):
    ctx = gpu_check.Ctx(cuda=False, work=str(tmp_path))
    log = open(tmp_path / "log", "w")

    def step(code, summary=gpu_check.pytest_summary):
        return gpu_check.Step("x", "test", lambda c: [sys.executable, "-c", code], (5, 5), summary)

    slow = gpu_check.run_step(step("import time; time.sleep(60)"), ctx, 1.0, log)
    assert slow["status"] == "timeout (1 s)" and slow["seconds"] < 30
    failed = gpu_check.run_step(step("print('FAILED tests/x.py::t'); raise SystemExit(3)"), ctx, 30.0, log)
    assert failed["status"] == "failed (exit 3)" and failed["numbers"]["failed_tests"] == ["tests/x.py::t"]
    broken = gpu_check.run_step(step("print('fine')", gpu_check.kernels_summary), ctx, 30.0, log)  # no kernels.json
    assert broken["status"] == "ok" and broken["headline"].startswith("no numbers: FileNotFoundError")
    log.close()


def test_a_spent_budget_skips_the_remaining_steps(tmp_path):
    plan = gpu_check.steps()
    args = argparse.Namespace(budget=0.0, only=["h", "i"], dry_run=False)
    with open(tmp_path / "log", "w") as log:
        gpu_check.run_all(plan, gpu_check.Ctx(cuda=False, work=str(tmp_path)), args, log)
    steps = {s.key: s.result for s in plan}
    assert steps["h"]["status"].startswith("skipped: out of the budget") and steps["i"]["status"].startswith(
        "skipped: out"
    )
    assert steps["a1"]["status"] == "skipped: not selected (--only)"
