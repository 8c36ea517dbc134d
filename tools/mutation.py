"""Mutation testing for trickles: does the test suite notice a one-line bug?

A *mutant* is one single-line change to ``trickles/comm.py``, ``trickles/parallel/*.py``, ``trickles/memory/*.py``
or ``trickles/optim/*.py``: an operator swapped (``+ -``, ``* /``, ``//`` to ``*``, ``| &``, ``< <=``, ``> >=``,
``== !=``, ``is``/``in`` negated, ``and or``, ``+= -=``, ``*= /=``), an integer off by one (a float doubled),
``True``/``False`` flipped, a ``not`` dropped, ``min``/``max`` swapped (also keywords: ``clamp(max=1.0)``), a call
statement removed (``x.add_(...)``, ``comm.all_reduce(t)``) or a returned value replaced by ``None``. Sites come
from ``ast``. Left alone: docstrings, comments, strings, f-strings, ``raise``/``assert``, logging, annotations,
defaults (function defaults, ``opt(...)`` config defaults), decorators, ``__repr__``/``__str__``, drawing code
(``pipeline_plot.py``, ``MemoryReport.plot``) and what only a GPU runs (``if``/``with`` on ``cuda``, lines naming
``cuda`` or a side ``_stream``). A seeded draw takes one mutant per line, modules round robin; a mutant that does
not compile is dropped.

All runs happen in private copies of the repository (``cp`` of the tree without ``.git``, one per job, under
``$TMPDIR``); the shared working tree is never touched. ``PYTHONPATH`` points at the copy and no bytecode is
written, so spawned ranks import the mutated source. The tests the chosen mutants need are first collected and
run unmutated (the *baseline*: a selector that matches nothing, or a test that fails or skips, is dropped with a
warning). Then per mutant: change the file, ``pytest -x -q`` the module's tests (``TESTS``, plus unit test files
that import the module), restore the file. Outcomes: ``killed`` (the first failing test named), ``survived``,
``timeout`` (past ``--timeout``, default 3x the tests' baseline time + 90 s: a hang; scored as killed, listed
apart) and ``error`` (nothing left to run; not scored). Mutants in ``EQUIVALENT`` run but are not scored.

  python3 tools/mutation.py --list --limit 48                  # the mutants a run would make, and their tests
  python3 tools/mutation.py --limit 48 --seed 0 --json mut.json
  python3 tools/mutation.py --module trickles/parallel/zero.py --limit 5
  python3 tools/mutation.py --patches /work/plausible_bugs --json bugs.json [--tests SELECTOR ...]

``--patches DIR`` applies each ``*.patch``/``*.diff`` of DIR (``patch -p1``) instead of a mutant and runs its
``# tests:`` line (or ``--tests``; else the tests mapped to the files it touches); its ``# bug:`` line names it.
A test selector is a path (file or directory), ``file::test`` (every case) or a node id; ``*`` matches anything.
"""

from __future__ import annotations

import argparse, ast, glob, json, os, random, re, shutil, signal, subprocess, sys, tempfile, time  # noqa: E401
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from queue import Queue

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["trickles/comm.py", "trickles/parallel/*.py", "trickles/memory/*.py", "trickles/optim/*.py"]
EXCLUDED_FILES = {"trickles/parallel/pipeline_plot.py"}  # matplotlib drawing only
SKIP_FUNCTIONS = {"__repr__", "__str__", "plot"}
QUIET_CALLS = {"print", "warn", "debug", "info", "warning", "error", "exception", "write_line", "opt"}

# --- the tests that cover each module: a fast subset (a run per mutant well under 2 minutes on 2 idle cores) ---
Z, DP, TP = "tests/distributed/test_zero.py", "tests/distributed/test_data_parallel.py", "tests/distributed/test_tensor_parallel.py"
PP, PR, C = "tests/distributed/test_pipeline.py", "tests/distributed/test_precision.py", "tests/distributed/test_comm.py"
MEM, SCH, CFG = "tests/unit/test_memory.py", "tests/unit/test_schedules.py", "tests/unit/test_config.py"
OVERFLOW = f"{PR}::test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank"
ZERO = [f"{Z}::test_layout_invariance[zero1-dp2-accum]", f"{Z}::test_layout_invariance[zero2-dp2-accum-offload]",
        f"{Z}::test_layout_invariance[zero1-dp4]", f"{Z}::test_memory_and_communication_match_the_formulas[2]",
        f"{Z}::test_checkpoint_resume_same_layout[1]", f"{Z}::test_checkpoint_resume_same_layout[2]"]
ZERO3 = [f"{Z}::test_layout_invariance[zero3-dp2-accum]", f"{Z}::test_layout_invariance[zero3-dp4-offload]",
         f"{Z}::test_zero3_never_holds_the_whole_model", f"{Z}::test_checkpoint_resume_same_layout[3]", ZERO[3], f"{OVERFLOW}[*3]"]
TENSOR = [f"{TP}::test_column_row_pair_matches_dense_forward_and_backward", f"{TP}::test_vocab_parallel_embedding_and_cross_entropy_match_dense",
          f"{TP}::test_replicated_key_value_heads_match_dense", f"{TP}::test_layout_invariance[tiny-dp1-tp2-sp]",
          f"{TP}::test_layout_invariance[gpt2-tiny-dp1-tp2-sp]", f"{TP}::test_layout_invariance[tiny-dp2-tp2-zero*1]",
          f"{TP}::test_collectives_per_step_match_megatron[2]", f"{TP}::test_dropout_streams_private_inside_regions_shared_outside"]
PIPE = [SCH, f"{PP}::test_layout_invariance[tiny-L8-dp1-tp1-pp2-*]", f"{PP}::test_layout_invariance[tiny-L7-*pp3*]",
        f"{PP}::test_layout_invariance[gpt2-*interleaved*micro_batch]", f"{PP}::test_pipeline_train_step_is_one_call_per_step"]
REPORT = [MEM, f"{PR}::test_memory_report_*", f"{TP}::test_memory_report_predicts_each_tensor_parallel_rank[tp2-sp]", ZERO[3]]
TESTS = {
    "trickles/comm.py": [C, TENSOR[0], f"{TENSOR[1]}[tp-sp-2]", f"{DP}::test_bucketed_matches_naive_oracle", ZERO[3]],
    "trickles/parallel/engine.py": ZERO[:4] + [f"{DP}::test_dp_matches_single_process[2-*]", f"{OVERFLOW}[*0]", TENSOR[3], PIPE[1],
                                               f"{PP}::test_layout_invariance[gpt2-tiny-L8-dp1-tp1-pp2-*]"],
    "trickles/parallel/flat.py": [f"{DP}::test_bucketed_matches_naive_oracle", *ZERO],
    "trickles/parallel/data.py": [DP, f"{OVERFLOW}[*0]"],
    "trickles/parallel/zero.py": ZERO + [f"{OVERFLOW}[*2]", f"{PR}::test_memory_report_measures_the_live_tensors[1]"],
    "trickles/parallel/zero3.py": ZERO3,
    "trickles/parallel/tensor.py": TENSOR, "trickles/parallel/tensor_plan.py": TENSOR,
    "trickles/parallel/pipeline.py": PIPE, "trickles/parallel/pipeline_runner.py": PIPE, "trickles/parallel/schedules.py": PIPE,
    "trickles/parallel/plan.py": [ZERO[0], ZERO3[0], TENSOR[3], PIPE[1]],
    "trickles/parallel/config.py": [CFG, f"{SCH}::test_bad_pipeline_configurations_are_refused_before_any_process_group"],
    "trickles/memory/config.py": [CFG],
    "trickles/memory/activations.py": REPORT + [f"{TP}::test_sequence_parallel_shrinks_activations_as_megatron_predicts"],
    "trickles/memory/report.py": REPORT, "trickles/memory/accounting.py": REPORT + [f"{Z}::test_zero_paper_worked_example"],
    "trickles/memory/scaler.py": [f"{MEM}::test_scaler_*", OVERFLOW, f"{PR}::test_fp16_loss_scale_resumes_exactly",
                                  f"{PR}::test_nonfinite_loss_stops_training_without_touching_the_weights"],
    "trickles/memory/precision.py": [f"{MEM}::test_recompute_gives_identical_losses_and_weights", f"{DP}::test_micro_batches_accumulate_in_place",
                                     f"{OVERFLOW}[*0]", f"{TP}::test_low_precision_tracks_fp32"],
    "trickles/memory/recompute.py": [f"{MEM}::test_recompute_gives_identical_losses_and_weights", f"{TP}::test_layout_invariance[*recompute*full]"],
    "trickles/optim/adamw.py": [ZERO[0], f"{DP}::test_dp_matches_single_process", ZERO3[0]],
    "trickles/optim/sharded.py": ZERO + ZERO3[:2] + [f"{DP}::test_dp_matches_single_process[2-*]"],
    "trickles/optim/schedule.py": [f"{DP}::test_dp_matches_single_process[2-*]", ZERO[0]],
}

# Mutants known to be equivalent (no input the library accepts behaves differently): (file, line text, change, reason).
EQUIVALENT = [
    ("trickles/parallel/zero.py", "MAX_INFLIGHT = 2  # stage 2: bucket buffers alive at once while reductions finish", "2 -> 3",
     "only how many stage-2 reductions overlap; gradients are the same and the memory report counts the live buffers"),
]

# --- finding mutation sites -----------------------------------------------------------------------------------
BIN = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"), ast.FloorDiv: ("//", "*"),
       ast.BitOr: ("|", "&"), ast.BitAnd: ("&", "|")}
CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"), ast.Eq: ("==", "!="),
       ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}


def _token(line: bytes, lo: int, hi: int, token: str):
    """``(start, end)`` of the one ``token`` between two operands (``line[lo:hi]``), or None."""
    pat = r"\b" + token.replace(" ", r"\s+") + r"\b" if token[0].isalpha() else re.escape(token)
    hits = list(re.finditer(pat.encode(), line[lo:hi]))
    return (lo + hits[0].start(), lo + hits[0].end()) if len(hits) == 1 else None


def _skipped(tree: ast.AST, text: str) -> set[int]:
    """ids of the nodes not to mutate (see the module docstring)."""
    skip, src = set(), text.splitlines()
    for node in ast.walk(tree):
        kids = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kids += [node] if node.name in SKIP_FUNCTIONS else []
            kids += [a.annotation for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs]
            kids += [node.returns, *node.args.defaults, *node.args.kw_defaults, *node.decorator_list]
        elif isinstance(node, (ast.If, ast.IfExp, ast.With)) and "cuda" in ast.unparse(getattr(node, "test", None) or node.items[0]):
            kids += [getattr(node, "test", None), *(node.body if isinstance(node.body, list) else [node.body])]
        elif isinstance(node, ast.stmt) and re.search(r"cuda|_stream\b", src[node.lineno - 1]):
            kids.append(node)
        if isinstance(node, ast.AnnAssign):
            kids.append(node.annotation)
        elif isinstance(node, (ast.Raise, ast.JoinedStr, ast.Assert)) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            kids.append(node)
        elif isinstance(node, ast.Call) and (getattr(node.func, "id", None) or getattr(node.func, "attr", "")) in QUIET_CALLS:
            kids.append(node)
        for k in filter(None, kids):
            skip.update(id(n) for n in ast.walk(k))
    return skip


def find_sites(rel: str, text: str) -> list[dict]:
    """Every mutation of ``rel``: ``{"file", "line", "col", "end", "new", "what"}`` (columns in UTF-8 bytes)."""
    tree, lines, out = ast.parse(text), [ln.encode() for ln in text.splitlines()], []
    skip = _skipped(tree, text)

    def add(line: int, span, new: str, what: str):
        if span:
            out.append({"file": rel, "line": line, "col": span[0], "end": span[1], "new": new, "what": what})

    def between(a, b, old, new):  # the operator token between operands a and b, on one line
        if a.end_lineno == b.lineno:
            add(b.lineno, _token(lines[b.lineno - 1], a.end_col_offset, b.col_offset, old), new, f"{old} -> {new}")

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in BIN:
            if not any(isinstance(getattr(s, "value", None), str) or isinstance(s, ast.JoinedStr) for s in (node.left, node.right)):
                between(node.left, node.right, *BIN[type(node.op)])
        elif isinstance(node, ast.AugAssign) and type(node.op) in BIN and BIN[type(node.op)][1] in "+-*/":
            between(node.target, node.value, *(t + "=" for t in BIN[type(node.op)]))
        elif isinstance(node, ast.Compare):
            for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
                between(left, right, *CMP[type(op)])
        elif isinstance(node, ast.BoolOp):
            for a, b in zip(node.values, node.values[1:]):
                between(a, b, *(("and", "or") if isinstance(node.op, ast.And) else ("or", "and")))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and node.lineno == node.operand.lineno:
            add(node.lineno, (node.col_offset, node.operand.col_offset), "", "drop not")
        elif isinstance(node, ast.Constant) and node.lineno == node.end_lineno and type(node.value) in (bool, int, float):
            v = node.value
            new = str(not v) if isinstance(v, bool) else str(v + 1) if isinstance(v, int) else repr(v * 2 if v else 1.0)
            add(node.lineno, (node.col_offset, node.end_col_offset), new,
                f"{lines[node.lineno - 1][node.col_offset:node.end_col_offset].decode()} -> {new}")
        elif isinstance(node, ast.Call):
            swap = {"min": "max", "max": "min"}
            if isinstance(node.func, ast.Name) and node.func.id in swap:
                f = node.func
                add(f.lineno, (f.col_offset, f.end_col_offset), swap[f.id], f"{f.id} -> {swap[f.id]}")
            for kw in node.keywords:
                if kw.arg in swap:
                    add(kw.lineno, (kw.col_offset, kw.col_offset + 3), swap[kw.arg], f"{kw.arg}= -> {swap[kw.arg]}=")
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and node.lineno == node.end_lineno:
            add(node.lineno, (node.col_offset, node.end_col_offset), "pass", "remove call")
        elif isinstance(node, ast.Return) and node.value is not None and node.lineno == node.end_lineno \
                and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            add(node.lineno, (node.value.col_offset, node.value.end_col_offset), "None", "return None")
    return out


def mutate(text: str, m: dict) -> str:
    lines = text.splitlines(keepends=True)
    b = lines[m["line"] - 1].encode()
    lines[m["line"] - 1] = (b[:m["col"]] + m["new"].encode() + b[m["end"]:]).decode()
    return "".join(lines)


def choose(modules: list[str], limit: int, seed: int) -> list[dict]:
    """A seeded spread: one mutant per line, modules taken round robin; mutants that do not compile are dropped."""
    rng, queues = random.Random(seed), []
    for rel in sorted(modules):
        text = open(os.path.join(ROOT, rel)).read()
        by_line: dict[int, list[dict]] = {}
        for m in find_sites(rel, text):
            try:
                compile(mutate(text, m), rel, "exec")
                by_line.setdefault(m["line"], []).append(m)
            except SyntaxError:
                pass
        lines = sorted(by_line)
        rng.shuffle(lines)
        queues.append([rng.choice(by_line[ln]) | {"text": text.splitlines()[ln - 1].strip()} for ln in lines])
    rng.shuffle(queues)
    out = []
    while any(queues) and len(out) < limit:
        out += [q.pop(0) for q in queues if q][:limit - len(out)]
    return out


def equivalent(m: dict) -> str | None:
    return next((r for f, t, w, r in EQUIVALENT if (f, t, w) == (m["file"], m.get("text"), m["what"])), None)


def tests_for(files: list[str]) -> list[str]:
    """The mapped tests of ``files``, and the unit test files that import them."""
    sel = []
    for f in files:
        pkg, mod = os.path.split(f[:-3])
        init = os.path.join(ROOT, pkg, "__init__.py")
        names = [re.escape(f[:-3].replace("/", "."))]
        if os.path.exists(init) and re.search(rf"^from \.{os.path.basename(mod)} import", open(init).read(), re.M):
            names.append(re.escape(f"from {pkg.replace('/', '.')} import"))
        sel += TESTS.get(f, []) + [os.path.relpath(t, ROOT) for t in sorted(glob.glob(os.path.join(ROOT, "tests/unit/test_*.py")))
                                   if re.search(rf"({'|'.join(names)})\b", open(t).read())]
    return list(dict.fromkeys(sel))


def matches(node: str, sel: str) -> bool:
    if "*" in sel:
        return re.fullmatch(re.escape(sel).replace(r"\*", ".*"), node) is not None
    return node == sel or node.startswith((sel + "::", sel + "[", sel.rstrip("/") + "/"))


# --- running ------------------------------------------------------------------------------------------------
class Workspace:
    """A private copy of the repository and an environment that imports from it."""

    def __init__(self, base: str, i: int):
        self.dir, self.basetemp = os.path.join(base, f"repo{i}"), os.path.join(base, f"pytest{i}")
        shutil.copytree(ROOT, self.dir, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "runs", "*.egg-info", ".venv"))
        self.env = {k: v for k, v in os.environ.items() if k != "CI"}  # a skip is not a kill
        self.env.update(PYTHONPATH=self.dir + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONDONTWRITEBYTECODE="1")
        got = subprocess.run([sys.executable, "-c", "import trickles; print(trickles.__file__)"], cwd=self.dir, env=self.env,
                             capture_output=True, text=True).stdout.strip()
        if not got.startswith(self.dir + os.sep):
            raise SystemExit(f"mutation: the copy does not import its own trickles ({got!r})")

    def pytest(self, args: list[str], timeout: float) -> tuple[int | None, str, float]:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={self.basetemp}", *args],
                             cwd=self.dir, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out = p.communicate(timeout=timeout)[0]
            return p.returncode, out, time.monotonic() - t0
        except subprocess.TimeoutExpired:
            _kill_tree(p.pid)
            return None, p.communicate()[0], time.monotonic() - t0


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (launched ranks sit in process groups of their own)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            children.setdefault(int(open(stat).read().rsplit(")", 1)[1].split()[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    todo = [pid]
    while todo:
        q = todo.pop()
        todo += children.get(q, [])
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass


def baseline(ws: Workspace, selections: list[list[str]]) -> tuple[dict[str, float], list[str]]:
    """Collects and runs every selected test once, unmutated: ``({node id: seconds} of those that pass, warnings)``."""
    wanted = sorted({s for sel in selections for s in sel})
    files = sorted({s.split("::")[0] for s in wanted if os.path.exists(os.path.join(ws.dir, s.split("::")[0]))})
    out = ws.pytest(["--collect-only", "-q", *files], 900)[1] if files else ""
    ids = [ln.strip() for ln in out.splitlines() if "::" in ln and not ln.startswith(("ERROR", "FAILED"))]
    warns = [f"collection: {ln}" for ln in out.splitlines() if ln.startswith("ERROR")]
    warns += [f"no test matches {s}" for s in wanted if not any(matches(i, s) for i in ids)]
    run = [i for i in ids if any(matches(i, s) for s in wanted)]
    xml = os.path.join(os.path.dirname(ws.dir), "baseline.xml")
    secs = ws.pytest(["-q", f"--junitxml={xml}", *run], 7200)[2] if run else 0.0
    print(f"baseline: {len(run)} tests in {secs:.0f} s", flush=True)
    by_key = {(i.split("::")[0][:-3].replace("/", "."), i.split("::", 1)[1]): i for i in run}
    passed = {}
    for case in ET.parse(xml).iter("testcase") if run else []:
        node = by_key.get((case.get("classname"), case.get("name")), f"{case.get('classname')}::{case.get('name')}")
        if any(c.tag in ("failure", "error", "skipped") for c in case):
            warns.append(f"fails or skips unmutated, left out: {node}")
        else:
            passed[node] = passed.get(node, 0.0) + float(case.get("time", 0))
    return passed, warns


def outcome(rc: int | None, out: str) -> tuple[str, str]:
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if rc is None:
        return "timeout", ""
    if rc == 0:
        return "survived", ""
    if rc == 1 and failed:
        return "killed", failed[0]
    return ("killed", "collection") if rc == 2 and "error during collection" in out else ("error", f"pytest status {rc}")


def run_one(m: dict, spaces: Queue, passed: dict[str, float], timeout: float | None) -> dict:
    """Applies mutant (or patch) ``m`` in a free workspace, runs its tests, restores the files."""
    ws = spaces.get()
    try:
        ids = [i for i in passed if any(matches(i, s) for s in m["tests"])]
        m.update(status="error", by="no passing test to run", seconds=0.0)
        saved = {f: open(os.path.join(ws.dir, f)).read() if os.path.exists(os.path.join(ws.dir, f)) else None
                 for f in (m["touched"] if "patch" in m else [m["file"]])}
        try:
            if "patch" in m:
                cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-s", "-i", m["patch"]]
                r = subprocess.run([*cmd, "--dry-run"], cwd=ws.dir, capture_output=True, text=True)
                ok = r.returncode == 0 and subprocess.run(cmd, cwd=ws.dir, capture_output=True).returncode == 0
                if not ok:
                    ids, m["by"] = [], "does not apply: " + ((r.stdout + r.stderr).strip().splitlines() or ["?"])[0]
            else:
                with open(os.path.join(ws.dir, m["file"]), "w") as fh:
                    fh.write(mutate(saved[m["file"]], m))
            if ids:
                rc, out, secs = ws.pytest(["-x", "-q", *ids], timeout or 3 * sum(passed[i] for i in ids) + 90)
                m.update(zip(("status", "by"), outcome(rc, out)), seconds=round(secs, 1))
        finally:
            for f, text in saved.items():
                path = os.path.join(ws.dir, f)
                if text is not None:
                    with open(path, "w") as fh:
                        fh.write(text)
                elif os.path.exists(path):
                    os.remove(path)
        m["equivalent"] = equivalent(m) if "line" in m else None
        where = f"{m['file']}:{m['line']}" if "line" in m else m["file"]
        print(f"{m['status']:<9} {where:<40} {m['what'][:60]:<16} {m.get('text', '')[:70]}  ({m['seconds']:.0f} s)"
              + (f"\n          by {m['by']}" if m["by"] else "") + (f"  [equivalent: {m['equivalent']}]" if m["equivalent"] else ""), flush=True)
        return m
    finally:
        spaces.put(ws)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", action="append", help="a module to mutate, e.g. trickles/parallel/zero.py (repeatable; default: all)")
    ap.add_argument("--limit", type=int, default=48, help="number of mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy of the repository")
    ap.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x its tests' baseline time + 90)")
    ap.add_argument("--list", action="store_true", help="print the mutants (or patches) and their tests; run nothing")
    ap.add_argument("--json", help="write every result and the score to this file")
    ap.add_argument("--patches", help="a directory of patches (plausible bugs) to run instead of mutants")
    ap.add_argument("--tests", nargs="+", help="run these test selectors instead of the mapped ones")
    args = ap.parse_args()
    if args.patches:
        jobs = []
        for path in sorted(glob.glob(os.path.join(args.patches, "*.patch")) + glob.glob(os.path.join(args.patches, "*.diff"))):
            text = open(path).read()
            named, bug = re.search(r"^# tests?:(.*)$", text, re.M), re.search(r"^# bug:(.*)$", text, re.M)
            touched = re.findall(r"^\+\+\+ b/(\S+)", text, re.M)
            jobs.append({"file": os.path.basename(path), "patch": os.path.abspath(path), "touched": touched, "what": bug.group(1).strip() if bug else "",
                         "tests": args.tests or (named.group(1).split() if named else tests_for(touched))})
    else:
        files = sorted({f for t in TARGETS for f in glob.glob(t, root_dir=ROOT)} - EXCLUDED_FILES)
        bad = [m for m in args.module or [] if m not in files]
        if bad:
            raise SystemExit(f"mutation: {bad} not among the target modules: {' '.join(files)}")
        jobs = choose(args.module or files, args.limit, args.seed)
        for m in jobs:
            m["tests"] = args.tests or tests_for([m["file"]])
    if args.list:
        for m in jobs:
            eq = equivalent(m) if "line" in m else None
            print((f"{m['file']}:{m['line']}  {m['what']:<14} {m['text']}" if "line" in m else f"{m['file']}: {m['what']}")
                  + (f"  [equivalent: {eq}]" if eq else "") + f"\n    tests: {' '.join(m['tests'])}")
        print(f"{len(jobs)} {'patches' if args.patches else 'mutants'}")
        return
    base = tempfile.mkdtemp(prefix="trickles-mutation-")
    try:
        spaces: Queue = Queue()
        for i in range(max(1, args.jobs)):
            spaces.put(Workspace(base, i))
        passed, warns = baseline(spaces.queue[0], [m["tests"] for m in jobs])
        for w in warns:
            print(f"warning: {w}")
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(lambda m: run_one(m, spaces, passed, args.timeout), jobs))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    scored = [r for r in results if not r["equivalent"] and r["status"] != "error"]
    caught = [r for r in scored if r["status"] in ("killed", "timeout")]
    score = {"scored": len(scored), "killed": sum(r["status"] == "killed" for r in scored),
             "timeout": sum(r["status"] == "timeout" for r in scored), "survived": len(scored) - len(caught),
             "equivalent": sum(bool(r["equivalent"]) for r in results), "error": sum(r["status"] == "error" for r in results),
             "score": round(len(caught) / len(scored), 4) if scored else None}
    print("\n" + " ".join(f"{k}={v}" for k, v in score.items()))
    for r in results:
        if r["status"] in ("survived", "timeout", "error"):
            print(f"  {r['status']}: {r['file']}:{r.get('line', '')} {r['what']}  {r.get('text', '')}  {r['by']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"score": score, "warnings": warns, "results": results, "seed": args.seed, "limit": args.limit}, fh, indent=1)


if __name__ == "__main__":
    main()
