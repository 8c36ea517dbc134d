"""Mutation testing for trickles: does the test suite notice a one-line bug?

A mutant is one single-line change to ``trickles/comm/*.py``, ``trickles/parallel/*.py`` (its subpackages too),
``trickles/memory/*.py``, ``trickles/optim/*.py``, ``trickles/kernels/*.py``, ``trickles/infer/*.py``,
``trickles/compress/*.py``, the fused projections' layout (``trickles/models/fused.py``) or the checkpoint pieces
(``trickles/train/pieces.py``), found with ``ast``: an operator swapped (``+ -``, ``* /``, ``// *``, ``| &``, ``< <=``,
``> >=``, ``== !=``, ``is``/``in`` negated, ``and or``, ``+= -=``, ``*= /=``), an int off by one (a float doubled),
``True``/``False`` flipped, a ``not`` dropped, ``min``/``max`` swapped (also ``clamp(max=)``), a call statement removed
(``x.add_(...)``, ``comm.all_reduce(t)``) or a returned value replaced by ``None``. Not mutated: docstrings, strings,
f-strings, ``raise``/``assert``, logging, annotations, defaults (arguments, ``opt(...)``), decorators,
``__repr__``/``__str__``, drawing (``pipeline/plot.py``, ``plot``) and GPU-only code (``if``/``with`` on ``cuda``, lines
naming ``cuda`` or a ``_stream``, ``non_blocking=``). A seeded draw takes one mutant per line, modules round robin;
mutants that do not compile are dropped.

Runs happen in private copies of the repository (``cp`` without ``.git``, one per job, under ``$TMPDIR``; the
shared tree is never touched), with ``PYTHONPATH`` on the copy and no bytecode written, so spawned ranks import
the mutated source. The tests the mutants need are collected and run once unmutated (a selector matching
nothing, or a test failing or skipping, is dropped with a warning); then per mutant: change the file, run
``pytest -x -q`` on the module's tests (``tools/mutants.toml``, plus unit test files importing the module),
restore the file.
Outcomes: killed (first failing test named), survived, timeout (past ``--timeout``, default 3x the tests'
baseline time + 90 s: a hang, scored as killed but listed apart), error (nothing to run; not scored). Mutants
listed as equivalent in ``mutants.toml`` run but are not scored.

  python3 tools/mutation.py --list --limit 48          # the mutants a run would make, and their tests
  python3 tools/mutation.py --limit 48 --seed 0 --json mutation.json [--jobs 2]
  python3 tools/mutation.py --module trickles/parallel/data/zero.py --limit 5
  python3 tools/mutation.py --patches /work/plausible_bugs --json bugs.json [--tests SELECTOR ...]
  python3 tools/mutation.py --rerun mutation.json --only survived --json mutation-rerun.json

``--rerun JSON`` runs the mutants of an earlier run again (the same draw: found again by their source line if the
file moved since, an error if the line is gone), with today's test map and equivalents; with ``--only STATUS ...``
just those that ended so, the others keeping their recorded outcome, and the score is over all of them.

``--patches DIR`` applies each ``*.patch``/``*.diff`` of DIR (``patch -p1``) in place of a mutant and runs its
``# tests:`` line (or ``--tests``; else the tests of the files it touches); its ``# bug:`` line names it. A test
selector is a path (file or directory), ``file::test`` (all its cases) or a node id; ``*`` matches anything.
"""

from __future__ import annotations

import argparse  # noqa: E401
import ast
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from queue import Queue

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = [
    "trickles/comm/*.py",
    "trickles/parallel/*.py",
    "trickles/parallel/*/*.py",
    "trickles/memory/*.py",
    "trickles/optim/*.py",
    "trickles/kernels/*.py",
    "trickles/infer/*.py",
    "trickles/compress/*.py",
    "trickles/models/fused.py",
    "trickles/models/documents.py",
    "trickles/data/loader.py",
    "trickles/train/pieces.py",
    "trickles/planner/*.py",
]
EXCLUDED_FILES = {"trickles/parallel/pipeline/plot.py"}  # matplotlib drawing only
SKIP_FUNCTIONS = {"__repr__", "__str__", "plot"}
QUIET_CALLS = {"print", "warn", "debug", "info", "warning", "error", "exception", "write_line", "opt"}
SKIP_KEYWORDS = {"non_blocking", "pin_memory"}  # only mean something on a GPU

with open(os.path.join(ROOT, "tools", "mutants.toml"), "rb") as _f:
    CONFIG = tomllib.load(_f)  # [tests]: module -> test selectors; [groups]; [[equivalent]]: see that file
EQUIVALENT = [(e["file"], e["line"], e["mutation"], e["reason"]) for e in CONFIG.get("equivalent", [])]


def mapped(module: str) -> list[str]:
    """The selectors ``mutants.toml`` maps ``module`` to (``@group`` expanded)."""
    return [t for s in CONFIG["tests"].get(module, []) for t in (CONFIG["groups"][s[1:]] if s.startswith("@") else [s])]


# --- finding mutation sites -----------------------------------------------------------------------------------
BIN = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "/"),
    ast.Div: ("/", "*"),
    ast.FloorDiv: ("//", "*"),
    ast.BitOr: ("|", "&"),
    ast.BitAnd: ("&", "|"),
}
CMP = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}


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
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kids += [node] if node.name in SKIP_FUNCTIONS else node.decorator_list
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kids += [a.annotation for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs]
            kids += [node.returns, *node.args.defaults, *node.args.kw_defaults]
        elif isinstance(node, (ast.If, ast.IfExp, ast.With)) and "cuda" in ast.unparse(
            getattr(node, "test", None) or node.items[0]
        ):
            kids += [getattr(node, "test", None), *(node.body if isinstance(node.body, list) else [node.body])]
        elif isinstance(node, ast.stmt) and re.search(r"cuda|_stream\b", src[node.lineno - 1]):
            kids.append(node)
        if isinstance(node, ast.AnnAssign):
            kids.append(node.annotation)
        elif isinstance(node, (ast.Raise, ast.JoinedStr, ast.Assert)) or (
            isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        ):
            kids.append(node)
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) or getattr(node.func, "attr", "")) in QUIET_CALLS
        ):
            kids.append(node)
        elif isinstance(node, ast.keyword) and node.arg in SKIP_KEYWORDS:
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
            if not any(
                isinstance(getattr(s, "value", None), str) or isinstance(s, ast.JoinedStr)
                for s in (node.left, node.right)
            ):
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
        elif (
            isinstance(node, ast.Constant) and node.lineno == node.end_lineno and type(node.value) in (bool, int, float)
        ):
            v = node.value
            new = str(not v) if isinstance(v, bool) else str(v + 1) if isinstance(v, int) else repr(v * 2 if v else 1.0)
            add(
                node.lineno,
                (node.col_offset, node.end_col_offset),
                new,
                f"{lines[node.lineno - 1][node.col_offset : node.end_col_offset].decode()} -> {new}",
            )
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
        elif (
            isinstance(node, ast.Return)
            and node.value is not None
            and node.lineno == node.end_lineno
            and not (isinstance(node.value, ast.Constant) and node.value.value is None)
        ):
            add(node.lineno, (node.value.col_offset, node.value.end_col_offset), "None", "return None")
    return out


def mutate(text: str, m: dict) -> str:
    lines = text.splitlines(keepends=True)
    b = lines[m["line"] - 1].encode()
    lines[m["line"] - 1] = (b[: m["col"]] + m["new"].encode() + b[m["end"] :]).decode()
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
        out += [q.pop(0) for q in queues if q][: limit - len(out)]
    return out


def relocate(m: dict) -> int:
    """The line of mutant ``m`` in today's source: its recorded line if unchanged, else the one line reading the same
    (stripped) nearest to it; the recorded line when there is none (the run then reports it as an error)."""
    lines = open(os.path.join(ROOT, m["file"])).read().splitlines()
    if m["line"] <= len(lines) and lines[m["line"] - 1].strip() == m["text"]:
        return m["line"]
    same = [i + 1 for i, ln in enumerate(lines) if ln.strip() == m["text"]]
    return min(same, key=lambda i: abs(i - m["line"])) if same else m["line"]


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
        units = sorted(glob.glob(os.path.join(ROOT, "tests/unit/test_*.py")))
        sel += mapped(f) + [
            os.path.relpath(t, ROOT) for t in units if re.search(rf"({'|'.join(names)})\b", open(t).read())
        ]
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
        shutil.copytree(
            ROOT,
            self.dir,
            ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "runs", "*.egg-info", ".venv"),
        )
        self.env = {k: v for k, v in os.environ.items() if k != "CI"}  # a skip is not a kill
        self.env.update(
            PYTHONPATH=self.dir + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONDONTWRITEBYTECODE="1"
        )
        got = subprocess.run(
            [sys.executable, "-c", "import trickles; print(trickles.__file__)"],
            cwd=self.dir,
            env=self.env,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if not got.startswith(self.dir + os.sep):
            raise SystemExit(f"mutation: the copy does not import its own trickles ({got!r})")

    def pytest(self, args: list[str], timeout: float) -> tuple[int | None, str, float]:
        """``(status or None on timeout, output, seconds)``; on timeout the whole process tree is killed."""
        t0 = time.monotonic()
        p = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={self.basetemp}", *args],
            cwd=self.dir,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            out = p.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:  # launched ranks sit in process groups of their own: walk the tree
            kids: dict[int, list[int]] = {}
            for stat in glob.glob("/proc/[0-9]*/stat"):
                try:
                    kids.setdefault(int(open(stat).read().rsplit(")", 1)[1].split()[1]), []).append(
                        int(stat.split("/")[2])
                    )
                except (OSError, IndexError, ValueError):
                    pass
            todo = [p.pid]
            while todo:
                q = todo.pop()
                todo += kids.get(q, [])
                try:
                    os.kill(q, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return None, p.communicate()[0], time.monotonic() - t0
        return p.returncode, out, time.monotonic() - t0


def baseline(ws: Workspace, selections: list[list[str]]) -> tuple[dict[str, float], list[str]]:
    """Collects and runs every selected test once, unmutated: ``({node id: seconds} of those that pass, warnings)``."""
    wanted = sorted({s for sel in selections for s in sel})
    files = sorted({s.split("::")[0] for s in wanted if os.path.exists(os.path.join(ws.dir, s.split("::")[0]))})
    out = ws.pytest(["--collect-only", "-q", *files], 900)[1] if files else ""
    ids = [ln.strip() for ln in out.splitlines() if "::" in ln and not ln.startswith(("ERROR", "FAILED"))]
    warns = [f"collection: {ln}" for ln in out.splitlines() if ln.startswith("ERROR")]
    warns += [f"no test matches {s}" for s in wanted if not any(matches(i, s) for i in ids)]
    run, xml = (
        [i for i in ids if any(matches(i, s) for s in wanted)],
        os.path.join(os.path.dirname(ws.dir), "baseline.xml"),
    )
    secs = ws.pytest(["-q", f"--junitxml={xml}", *run], 7200)[2] if run else 0.0
    print(f"baseline: {len(run)} tests in {secs:.0f} s", flush=True)
    by_key, passed = {(i.split("::")[0][:-3].replace("/", "."), i.split("::", 1)[1]): i for i in run}, {}
    for case in ET.parse(xml).iter("testcase") if run else []:
        node = by_key.get((case.get("classname"), case.get("name")), f"{case.get('classname')}::{case.get('name')}")
        if any(c.tag in ("failure", "error", "skipped") for c in case):
            warns.append(f"fails or skips unmutated, left out: {node}")
        else:
            passed[node] = passed.get(node, 0.0) + float(case.get("time", 0))
    return passed, warns


def run_one(m: dict, spaces: Queue, passed: dict[str, float], timeout: float | None) -> dict:
    """Applies mutant (or patch) ``m`` in a free workspace, runs its tests, restores the files; prints the outcome."""
    ws = spaces.get()
    ids = [i for i in passed if any(matches(i, s) for s in m["tests"])]
    m.update(status="error", by="no passing test to run", seconds=0.0)
    saved = {
        f: open(os.path.join(ws.dir, f)).read() if os.path.exists(os.path.join(ws.dir, f)) else None
        for f in m.get("touched", [m["file"]])
    }
    try:
        if "patch" in m:
            cmd = ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-s", "-i", m["patch"]]
            r = subprocess.run([*cmd, "--dry-run"], cwd=ws.dir, capture_output=True, text=True)
            if r.returncode or subprocess.run(cmd, cwd=ws.dir, capture_output=True).returncode:
                ids, m["by"] = [], "does not apply: " + ((r.stdout + r.stderr).strip().splitlines() or ["?"])[0]
        elif (saved[m["file"]].splitlines()[m["line"] - 1 : m["line"]] or [""])[0].strip() != m["text"]:
            ids, m["by"] = [], "the mutated line is not in the source (changed since the mutant was drawn)"
        else:
            with open(os.path.join(ws.dir, m["file"]), "w") as fh:
                fh.write(mutate(saved[m["file"]], m))
        if ids:
            rc, out, secs = ws.pytest(["-x", "-q", *ids], timeout or 3 * sum(passed[i] for i in ids) + 90)
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
            m.update(
                status="timeout"
                if rc is None
                else "survived"
                if rc == 0
                else "killed"
                if rc in (1, 2) and failed
                else "error",
                by=failed[0] if rc and failed else "" if rc in (None, 0) else f"pytest status {rc}",
                seconds=round(secs, 1),
            )
    finally:
        for f, text in saved.items():
            if text is not None:
                with open(os.path.join(ws.dir, f), "w") as fh:
                    fh.write(text)
            elif os.path.exists(os.path.join(ws.dir, f)):
                os.remove(os.path.join(ws.dir, f))
        spaces.put(ws)
    m["equivalent"] = equivalent(m) if "line" in m else None
    where = f"{m['file']}:{m['line']}" if "line" in m else m["file"]
    print(
        f"{m['status']:<9} {where:<40} {m['what'][:60]:<16} {m.get('text', '')[:70]}  ({m['seconds']:.0f} s)"
        + (f"\n          by {m['by']}" if m["by"] else "")
        + (f"  [equivalent: {m['equivalent']}]" if m["equivalent"] else ""),
        flush=True,
    )
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--module",
        action="append",
        help="a module to mutate, e.g. trickles/parallel/data/zero.py (repeatable; default: all)",
    )
    ap.add_argument("--limit", type=int, default=48, help="number of mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy of the repository")
    ap.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x its tests' baseline time + 90)")
    ap.add_argument("--list", action="store_true", help="print the mutants (or patches) and their tests; run nothing")
    ap.add_argument("--json", help="write every result and the score to this file")
    ap.add_argument("--patches", help="a directory of patches (plausible bugs) to run instead of mutants")
    ap.add_argument("--tests", nargs="+", help="run these test selectors instead of the mapped ones")
    ap.add_argument("--rerun", metavar="JSON", help="run the mutants of an earlier run's --json output again")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=["killed", "timeout", "survived", "error"],
        help="with --rerun: only the mutants that ended so; the others keep their recorded outcome",
    )
    args = ap.parse_args()
    carried: dict[int, dict] = {}
    if args.only and not args.rerun:
        raise SystemExit("mutation: --only goes with --rerun JSON")
    if args.rerun:
        earlier = [r for r in json.load(open(args.rerun))["results"] if "line" in r]
        jobs = []
        for i, r in enumerate(earlier):
            m = {k: r[k] for k in ("file", "line", "col", "end", "new", "what", "text")}
            m["line"] = relocate(m)
            m["tests"] = args.tests or tests_for([m["file"]])
            if args.only and r["status"] not in args.only:
                carried[i] = m | {k: r[k] for k in ("status", "by", "seconds")} | {"equivalent": equivalent(m)}
            else:
                jobs.append(m)
        print(f"rerun of {args.rerun}: {len(jobs)} mutants to run, {len(carried)} outcomes carried over", flush=True)
    elif args.patches:
        jobs = []
        for path in sorted(
            glob.glob(os.path.join(args.patches, "*.patch")) + glob.glob(os.path.join(args.patches, "*.diff"))
        ):
            text = open(path).read()
            named, bug = re.search(r"^# tests?:(.*)$", text, re.M), re.search(r"^# bug:(.*)$", text, re.M)
            touched = re.findall(r"^\+\+\+ b/(\S+)", text, re.M)
            jobs.append(
                {
                    "file": os.path.basename(path),
                    "patch": os.path.abspath(path),
                    "touched": touched,
                    "what": bug.group(1).strip() if bug else "",
                    "tests": args.tests or (named.group(1).split() if named else tests_for(touched)),
                }
            )
    else:
        files = sorted({f for t in TARGETS for f in glob.glob(t, root_dir=ROOT)} - EXCLUDED_FILES)
        if set(args.module or []) - set(files):
            raise SystemExit(f"mutation: --module must be one of: {' '.join(files)}")
        jobs = [
            m | {"tests": args.tests or tests_for([m["file"]])}
            for m in choose(args.module or files, args.limit, args.seed)
        ]
    if args.list:
        for m in jobs:
            eq = equivalent(m) if "line" in m else None
            print(
                (
                    f"{m['file']}:{m['line']}  {m['what']:<14} {m['text']}"
                    if "line" in m
                    else f"{m['file']}: {m['what']}"
                )
                + (f"  [equivalent: {eq}]" if eq else "")
                + f"\n    tests: {' '.join(m['tests'])}"
            )
        return print(f"{len(jobs)} {'patches' if args.patches else 'mutants'}")
    base, spaces = tempfile.mkdtemp(prefix="trickles-mutation-"), Queue()
    try:
        for i in range(max(1, args.jobs)):
            spaces.put(Workspace(base, i))
        passed, warns = baseline(spaces.queue[0], [m["tests"] for m in jobs])
        print("".join(f"warning: {w}\n" for w in warns), end="")
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            ran = iter(pool.map(lambda m: run_one(m, spaces, passed, args.timeout), jobs))
            results = [carried[i] if i in carried else next(ran) for i in range(len(jobs) + len(carried))]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    scored = [r for r in results if not r["equivalent"] and r["status"] != "error"]
    caught = sum(r["status"] in ("killed", "timeout") for r in scored)
    score = {
        "scored": len(scored),
        **{k: sum(r["status"] == k for r in scored) for k in ("killed", "timeout", "survived")},
        "equivalent": sum(bool(r["equivalent"]) for r in results),
        "error": sum(r["status"] == "error" for r in results),
        "score": round(caught / len(scored), 4) if scored else None,
    }
    print("\n" + " ".join(f"{k}={v}" for k, v in score.items()))
    print(
        "".join(
            f"  {r['status']}: {r['file']}:{r.get('line', '')} {r['what']}  {r.get('text', '')}  {r['by']}\n"
            for r in results
            if r["status"] in ("survived", "timeout", "error")
        ),
        end="",
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"score": score, "warnings": warns, "results": results, "seed": args.seed, "limit": args.limit},
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
