"""``benchmarks/gpu_check.py`` without a GPU: the CPU smoke run of one step with every step in the JSON and the table,
the plan of a dry run, a step that fails, runs out of time or gives no numbers being recorded while the run goes on,
the report written after every step, and the exit status of a run that did not get every number."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.append(BENCH)  # last: the benchmarks' module names shadow nothing of the suite's

import gpu_check  # noqa: E402

from trickles.testing import run_command  # noqa: E402

KEYS = [s.key for s in gpu_check.steps()]
ENV = dict.fromkeys(["device", "date", "torch", "cuda", "triton", "transformers", "accelerate", "liger_kernel"], "-")
ENV["commit"] = "-"


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
    assert broken["status"] == "no result" and broken["headline"].startswith("no numbers: FileNotFoundError")
    silent = gpu_check.run_step(step("print('fine')"), ctx, 30.0, log)  # pytest's step without pytest's summary line
    assert silent["status"] == "no result" and silent["numbers"] == {}
    log.close()


def _fake(key, code, summary=None):
    """A step running ``python -c code``, its numbers what ``summary`` returns (none by default)."""
    none = {"headline": "", "numbers": {}, "header": [], "rows": []}
    return gpu_check.Step(
        key, f"fake {key}", lambda c: [sys.executable, "-c", code], (30, 30), summary or (lambda c, o: none)
    )


def test_the_report_is_written_after_every_step_and_a_step_without_numbers_fails_the_run(tmp_path):
    out = tmp_path / "out"

    def on_disk(ctx, output):  # what a run killed during this step would have left
        doc, steps, table = _written(out)
        return {"headline": "", "numbers": {k: s["status"] for k, s in steps.items()}, "header": [], "rows": []}

    plan = [
        _fake("x1", "print(1)", lambda c, o: {"headline": "1", "numbers": {"one": 1}, "header": [], "rows": []}),
        _fake("x2", "print(2)", on_disk),
        _fake("x3", "print(3)"),  # exits 0, no numbers
    ]
    ctx = gpu_check.Ctx(cuda=False, work=str(tmp_path))
    args = argparse.Namespace(budget=120.0, only=None, dry_run=False, out=str(out))
    assert gpu_check.check(plan, ctx, args, ENV) == 1
    assert plan[1].result["numbers"] == {"x1": "ok", "x2": "pending", "x3": "pending"}
    doc, steps, table = _written(out)
    assert doc["finished"] and [s["status"] for s in doc["steps"]] == ["ok", "ok", "no result"]
    assert "| x3 | fake x3 | no result |" in table

    args.only = ["x1", "x2"]  # what was not asked for is not missing
    assert gpu_check.check(plan, ctx, args, ENV) == 0


def test_a_spent_budget_skips_the_remaining_steps_and_fails_the_run(tmp_path):
    plan = gpu_check.steps()
    args = argparse.Namespace(budget=0.0, only=["h", "i"], dry_run=False, out=str(tmp_path / "out"))
    assert gpu_check.check(plan, gpu_check.Ctx(cuda=False, work=str(tmp_path)), args, ENV) == 1
    steps = {s.key: s.result for s in plan}
    assert steps["h"]["status"].startswith("skipped: out of the budget") and steps["i"]["status"].startswith(
        "skipped: out"
    )
    assert steps["a1"]["status"] == "skipped: not selected (--only)"


def test_only_names_every_step_in_its_help(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--help"])
    assert ",".join(KEYS) in capsys.readouterr().out and {"j", "k", "l"} <= set(KEYS)


def test_a_terminated_run_ends_its_running_step(tmp_path):
    """SIGTERM to the script while a step runs: the script exits 143 and the step's process is gone too."""
    pid_file, out = tmp_path / "pid", tmp_path / "step.log"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = (
        f"import sys; sys.path.append({BENCH!r}); import gpu_check; gpu_check.unwind_on_sigterm(); "
        f"gpu_check.run_bounded([sys.executable, '-c', {child!r}], 300, {str(out)!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    step_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    with pytest.raises(ProcessLookupError):
        os.kill(step_pid, 0)
