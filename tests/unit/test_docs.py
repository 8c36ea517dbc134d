"""The documentation is checked against the code it describes, and the start-up warnings against their cases.

* every config key (from the section dataclasses) and every ``trickles`` command and option (from the CLI's
  argparse) appears in README.md or docs/, and no page names a key that does not exist;
* docs/configuration.md's key tables are exactly what ``trickles.config.keys_markdown()`` renders from the rows
  ``trickles config --keys`` prints (``TRICKLES_WRITE_DOCS=1`` rewrites them);
* every relative link (and its ``#anchor``) in README.md and docs/*.md resolves;
* the README's two set-up commands are the ones ``.ci/run`` runs, and its tour commands (like every command in a
  ``bash`` block of the docs) parse with the CLI's own parser, name existing examples and validate at their
  number of ranks;
* :mod:`trickles.hints` warns exactly in its cases, and fp16 on a CPU prints its warning once and still trains.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import math
import os
import re
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch

from trickles.cli import _parser
from trickles.config import Config, describe_keys, key_rows, keys_markdown
from trickles.errors import ConfigError, UserError
from trickles.hints import DeviceFacts, device_facts, slow_config_hints, warn_slow_config
from trickles.planner.elastic import layout_for_world
from trickles.testing import run_command

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
SECTIONS = {section for section, *_ in key_rows()}
BEGIN, END = "<!-- BEGIN GENERATED: trickles.config.keys_markdown() -->\n", "<!-- END GENERATED -->"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _all_docs() -> dict[Path, str]:
    return {p: _text(p) for p in [README, *PAGES]}


def _fenced(text: str, lang: str | None = None) -> list[str]:
    """The bodies of the fenced code blocks of ``text`` (of language ``lang``, if given)."""
    blocks = re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    return [body for language, body in blocks if lang is None or language == lang]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _readme_section(title: str) -> str:
    parts = re.split(r"^## ", _text(README), flags=re.M)
    found = [p for p in parts if p.startswith(title)]
    assert len(found) == 1, f"README.md needs exactly one '## {title}' section"
    return found[0]


def _command_lines(block: str) -> list[list[str]]:
    """Each logical line of a shell block (backslash continuations joined) as tokens, comments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens:
            out.append(tokens)
    return out


def _segments(tokens: list[str]) -> list[list[str]]:
    """A command line cut at ``&&``."""
    segs, cur = [], []
    for t in tokens:
        if t == "&&":
            segs.append(cur)
            cur = []
        else:
            cur.append(t)
    return segs + [cur]


def _trickles_invocation(tokens: list[str]) -> tuple[list[str], int | None] | None:
    """``(argv after 'trickles', world size from torchrun or None)`` when ``tokens`` runs trickles, else None."""
    tokens = tokens[: next((i for i, t in enumerate(tokens) if t in ("|", ">", ">>", "<", "2>&1")), len(tokens))]
    if tokens[:3] == ["python3", "-m", "trickles"]:
        return tokens[3:], None
    if tokens and tokens[0] == "torchrun" and "-m" in tokens:
        i = tokens.index("-m")
        if tokens[i + 1] != "trickles":
            return None
        opts = tokens[1:i]
        value = lambda name, default: int(opts[opts.index(name) + 1]) if name in opts else default  # noqa: E731
        return tokens[i + 2 :], value("--nnodes", 1) * value("--nproc-per-node", 1)
    return None


def _documented_invocations(text: str) -> list[tuple[list[str], int | None]]:
    found = []
    for block in _fenced(text, "bash"):
        for tokens in _command_lines(block):
            for seg in _segments(tokens):
                inv = _trickles_invocation(seg)
                if inv is not None:
                    found.append(inv)
    return found


def _check_invocation(argv: list[str], torchrun_world: int | None):
    """Parses ``argv`` with the CLI's parser and validates its configuration at its number of ranks; returns
    ``(args, config or None)``."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the CLI does not accept the documented command: trickles {shlex.join(argv)}")
    cfg = None
    if args.command in ("train", "memory", "config", "bench"):
        path = args.config
        if path is not None and (path.startswith("examples/") or not path.endswith(".toml")):
            assert (ROOT / path).is_file(), f"trickles {shlex.join(argv)}: {path} does not exist"
        elif path is not None:
            path = None  # a placeholder (my.toml, run.toml): its --set keys are still checked
        overrides = list(args.overrides) + (
            [f"train.pipeline_trace={args.pipeline_trace}"] if getattr(args, "pipeline_trace", None) else []
        )
        try:
            cfg = Config.load(ROOT / path if path else None, overrides)
            if args.command == "bench":
                from trickles.train.scaling import plan

                plan(cfg, args.ranks or [1, 2], args.steps, args.warmup)
            elif args.command != "config":  # (parallel.elastic: on the layout the command would choose)
                world = args.nproc or torchrun_world or 1
                layout_for_world(cfg, world)[0].validate(world)
        except UserError as e:
            pytest.fail(f"the documented command trickles {shlex.join(argv)} is refused: {e}")
    return args, cfg


# ---- every key, command and option is documented; nothing stale ------------------------------------------------


def test_every_config_key_appears_in_the_docs():
    text = "\n".join(_all_docs().values())
    missing = [f"{s}.{k}" for s, k, *_ in key_rows() if f"{s}.{k}" not in text]
    assert not missing, f"config keys no page mentions: {missing}"


def test_no_page_names_a_key_that_does_not_exist():
    keys = {f"{s}.{k}" for s, k, *_ in key_rows()}
    files = {"png", "json", "jsonl", "toml", "py", "md", "txt", "bin", "npy", "safetensors"}
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(SECTIONS) + r")\.([A-Za-z_]\w*)")
    stale = set()
    for path, text in _all_docs().items():
        for span in re.findall(r"`([^`\n]+)`", text) + _fenced(text):
            for section, key in pattern.findall(span):
                if key not in files and f"{section}.{key}" not in keys:
                    stale.add((path.name, f"{section}.{key}"))
    assert not stale, f"pages name keys the config does not have: {sorted(stale)}"


def _cli_commands():
    """``[(command words, parser)]`` for every (sub)command of the CLI, from its argparse."""
    import argparse

    out = []

    def walk(parser, words):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out.append((words, parser))
        for action in subs:
            for name, sub in action.choices.items():
                walk(sub, [*words, name])

    walk(_parser(), [])
    return out


def test_every_command_and_option_appears_in_the_docs():
    readme, text = _text(README), "\n".join(_all_docs().values())
    commands = _cli_commands()
    assert {" ".join(w) for w, _ in commands} >= {
        "train",
        "generate",
        "memory",
        "config",
        "bench scaling",
        "checkpoint export",
    }
    for words, parser in commands:
        command = "trickles " + " ".join(words)
        assert command in readme, f"README.md does not mention `{command}`"
        assert command in "\n".join(_text(p) for p in PAGES), f"no page in docs/ documents `{command}`"
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in text, f"`{command} {option}` is not documented"


def test_public_api_is_documented():
    import trickles

    page = _text(ROOT / "docs" / "python-api.md")
    missing = [name for name in trickles.__all__ if not re.search(rf"\b{name}\b", page)]
    assert not missing, f"docs/python-api.md does not mention {missing}"


# ---- the configuration page is generated from the same rows as `trickles config --keys` ----------------------------


def test_configuration_page_is_the_generated_reference():
    path = ROOT / "docs" / "configuration.md"
    text = _text(path)
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{path} lost its generated-region markers"
    head, rest = text.split(BEGIN)
    body, tail = rest.split(END)
    if os.environ.get("TRICKLES_WRITE_DOCS") == "1":
        path.write_text(head + BEGIN + keys_markdown() + END + tail, encoding="utf-8")
        body = keys_markdown()
    assert body == keys_markdown(), (
        "docs/configuration.md is out of date with the config dataclasses; regenerate it: "
        "TRICKLES_WRITE_DOCS=1 python3 -m pytest tests/unit/test_docs.py"
    )


def test_config_keys_command_and_page_list_the_same_keys(capsys):
    from trickles.cli import main

    assert main(["config", "--keys"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == describe_keys().strip()
    cli_keys = re.findall(r"^  (\w+\.[\w.\[\]]+) = ", printed, flags=re.M)  # (a table's keys: data.sources[].path)
    page_keys = re.findall(r"^\| `(\w+\.[\w.\[\]]+)` \|", _text(ROOT / "docs" / "configuration.md"), flags=re.M)
    assert cli_keys == page_keys == [f"{s}.{k}" for s, k, *_ in key_rows()]


# ---- links ---------------------------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower()).replace("_", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _without_code_blocks(_text(path)), flags=re.M)}


def test_every_relative_link_resolves():
    checked = 0
    for path, text in _all_docs().items():
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(text)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.name}: link to {target} -- {dest} does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{path.name}: link to {target} -- no heading #{anchor} in {dest.name}"
            checked += 1
    assert checked >= 20, "expected the README and pages to link to each other"


def test_readme_links_every_page_and_marks_what_is_not_built():
    readme = _text(README)
    linked = {(ROOT / t).resolve() for t in re.findall(r"\]\((docs/[^)#\s]+)", readme)}
    assert {p.resolve() for p in PAGES} == linked, "every docs/ page is linked from the README, and only those exist"
    rows = [
        r
        for r in _readme_section("What it does").splitlines()
        if r.startswith("| ") and not r.startswith("| technique")
    ]
    planned = [r for r in rows if "not yet" in r]
    assert planned, "the README's table lists the planned features as 'not yet'"
    for key, needs in (("parallel.cp", []), ("parallel.ep", ["model.moe_experts=4"])):
        try:  # a parallel degree the config accepts (with what it needs) is built; one it refuses is not
            Config.load(None, [f"{key}=2", *needs]).validate(2)
            built = True
        except ConfigError:
            built = False
        row = next(r for r in rows if f"`{key}`" in r)
        assert (row not in planned) == built, (
            f"{key} is {'built' if built else 'refused'}, but its README row says otherwise: {row}"
        )
    for row in rows:
        has_link = re.search(r"\]\(docs/", row) is not None
        assert has_link != (row in planned), f"a built technique links its page, a planned one none: {row}"


# ---- the README's commands are the ones CI and the examples use ---------------------------------------------------


def _ci_test_command() -> list[str]:
    lines = [
        line for line in _text(ROOT / ".ci" / "run").splitlines() if "install.sh" in line and not line.startswith("#")
    ]
    assert len(lines) == 1, ".ci/run should run the test command on one line"
    tokens = shlex.split(lines[0])
    stop = next((i for i, t in enumerate(tokens) if t in ("|", "2>&1", ">", ";")), len(tokens))
    # CI may lint between the install and the tests (``python3 -m ruff ...`` segments); the rest is the README's
    segs = [seg for seg in _segments(tokens[:stop]) if seg[:3] != ["python3", "-m", "ruff"]]
    assert len(segs) == len(_segments(tokens[:stop])) - 2, ".ci/run should run ruff check and ruff format --check"
    return [t for i, seg in enumerate(segs) for t in (["&&"] if i else []) + seg]


def test_setup_commands_are_what_ci_runs_and_the_demo():
    blocks = _fenced(_readme_section("Set up"), "bash")
    assert len(blocks) == 1
    demo, test = _command_lines(blocks[0])
    ci = _ci_test_command()
    extra = ci[len(test) :]
    selecting = ("-k", "-m", "--deselect", "--ignore", "--lf", "-x", "--exitfirst")
    assert ci[: len(test)] == test and all(t.startswith("-") and not t.startswith(selecting) for t in extra), (
        f"README's test command {shlex.join(test)} is not what .ci/run runs ({shlex.join(ci)}; CI may only add report "
        "options)"
    )
    install, run = _segments(demo)
    assert install + ["test"] == _segments(test)[0], "the demo installs like the test command, without the test extras"
    argv, _ = _trickles_invocation(run)
    args, cfg = _check_invocation(argv, None)
    assert args.command == "train" and args.config is None and not args.overrides and args.nproc is None, (
        "the demo takes no options"
    )
    written_out = Config.load(ROOT / "examples" / "demo.toml")
    assert cfg.to_dict() | {"model": {}} == written_out.to_dict() | {"model": {}}
    assert {k: v for k, v in vars(cfg.model).items() if k != "preset"} == {
        k: v for k, v in vars(written_out.model).items() if k != "preset"
    }, "examples/demo.toml is the demo written out"


def test_tour_commands_parse_validate_and_cover_the_tour():
    section = _readme_section("A two-minute tour")
    runs = _documented_invocations(section)
    assert len(runs) >= 5
    checked = [(argv, world, *_check_invocation(argv, world)) for argv, world in runs]
    demo_out = Config.load(None).train.out_dir

    assert any(argv == ["train"] for argv, *_ in checked), "the tour starts with the demo"
    assert any(a.command == "train" and (a.nproc or 1) > 1 for _, _, a, _ in checked), "a parallel run with --nproc"
    assert any(a.command == "memory" for _, _, a, _ in checked), "`trickles memory`"
    gens = [a for _, _, a, _ in checked if a.command == "generate"]
    assert gens and all(a.checkpoint == demo_out for a in gens), "`trickles generate` samples from the demo's run"
    assert any(w and w > 1 and a.command == "train" for _, w, a, _ in checked), "torchrun across machines"
    outs = [cfg.train.out_dir for _, _, a, cfg in checked if a.command == "train"]
    assert len(outs) == len(set(outs)), f"each training run of the tour needs its own out_dir, got {outs}"
    examples = {str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.toml")}
    assert all(a.config in examples for _, _, a, _ in checked if getattr(a, "config", None)), (
        "tour configs are examples/"
    )


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_documented_command_parses_and_validates(page):
    for argv, world in _documented_invocations(_text(page)):
        _check_invocation(argv, world)


def test_python_blocks_compile_and_import_what_exists():
    for path, text in _all_docs().items():
        for block in _fenced(text, "python"):
            tree = ast.parse(block, filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    module = importlib.import_module(node.module)
                    for alias in node.names:
                        assert hasattr(module, alias.name), f"{path.name}: {node.module} has no {alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        importlib.import_module(alias.name)


# ---- start-up warnings -----------------------------------------------------------------------------------------


def _cfg(*overrides):
    return Config.load(None, list(overrides))


CPU_PLAIN = DeviceFacts("cpu", fp16_matmul=False, bf16_matmul=True)


def test_fp16_on_a_cpu_without_fp16_matmuls_warns_with_what_to_change():
    (line,) = slow_config_hints(_cfg("memory.precision=fp16"), CPU_PLAIN, local_ranks=1, cores=2)
    assert line.startswith("warning: memory.precision=fp16") and "slower than fp32" in line
    assert "use memory.precision=bf16 or fp32" in line and "\n" not in line
    assert line in _text(ROOT / "docs" / "memory.md"), "docs/memory.md quotes the warning as it is printed"
    (line,) = slow_config_hints(
        _cfg("memory.precision=fp16"), DeviceFacts("cpu", fp16_matmul=False, bf16_matmul=False), 1, 2
    )
    assert "use memory.precision=fp32 on CPU" in line  # no bf16 either: only fp32 is fast
    assert slow_config_hints(_cfg("memory.precision=fp16"), DeviceFacts("cpu", fp16_matmul=True), 1, 2) == []
    for precision in ("fp32", "bf16"):
        assert slow_config_hints(_cfg(f"memory.precision={precision}"), CPU_PLAIN, 1, 2) == []


def test_bf16_on_a_gpu_without_bf16_warns():
    old_gpu = DeviceFacts("cuda", "Tesla V100", fp16_matmul=True, bf16_matmul=False)
    (line,) = slow_config_hints(_cfg("memory.precision=bf16"), old_gpu, 1, 16)
    assert line.startswith("warning: memory.precision=bf16") and "Tesla V100" in line and "fp16" in line
    assert slow_config_hints(_cfg("memory.precision=fp16"), old_gpu, 1, 16) == []
    assert slow_config_hints(_cfg("memory.precision=bf16"), DeviceFacts("cuda", "H100"), 1, 16) == []


def test_more_ranks_than_cores_warns():
    (line,) = slow_config_hints(_cfg(), CPU_PLAIN, local_ranks=4, cores=2)
    assert line.startswith("warning: 4 ranks on this machine share 2 CPU cores") and "at most 2 ranks" in line
    assert slow_config_hints(_cfg(), CPU_PLAIN, local_ranks=2, cores=2) == []
    both = slow_config_hints(_cfg("memory.precision=fp16"), CPU_PLAIN, local_ranks=3, cores=1)
    assert len(both) == 2 and "1 CPU core," in both[1]


def test_warnings_print_on_rank_zero_only(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("TRICKLES_RESTART", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr("trickles.hints.device_facts", lambda device: CPU_PLAIN)
    cfg = _cfg("memory.precision=fp16")
    for is_main, expected in ((True, 1), (False, 0)):
        out = io.StringIO()
        lines = warn_slow_config(cfg, types.SimpleNamespace(is_main=is_main, device=torch.device("cpu")), file=out)
        assert len(lines) == expected and out.getvalue().count("warning:") == expected
    monkeypatch.setenv("TRICKLES_RESTART", "1")  # a restarted job said it already
    assert (
        warn_slow_config(cfg, types.SimpleNamespace(is_main=True, device=torch.device("cpu")), file=io.StringIO()) == []
    )


def test_device_facts_of_this_cpu():
    facts = device_facts("cpu")
    assert facts.kind == "cpu" and isinstance(facts.fp16_matmul, bool)


def test_fp16_on_cpu_prints_the_warning_once_and_trains(tmp_path):
    """Two ranks through the CLI: rank 0 alone warns, once, and both steps train."""
    expected = 0 if device_facts("cpu").fp16_matmul else 1  # a CPU with fp16 matmuls has nothing to warn about
    out = tmp_path / "run"
    sets = [
        "model.preset=tiny",
        "data.seq_len=32",
        "train.global_batch=8",
        "data.max_bytes=120000",
        "train.steps=2",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.plot=false",
        "train.device=cpu",
        "memory.precision=fp16",
        "memory.loss_scale=256",  # far from overflow (gradient norms ~4), so both steps update the weights
        f"train.out_dir={out}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    cmd = [sys.executable, "-m", "trickles", "train", "--nproc", "2", "--quiet"] + [
        x for s in sets for x in ("--set", s)
    ]
    r = run_command(cmd, cwd=ROOT, text=True, timeout=540)
    assert r.returncode == 0, r.stderr
    output = r.stdout + r.stderr
    assert output.count("warning: memory.precision=fp16") == expected, output
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [s["step"] for s in steps] == [1, 2], steps
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) and not s["skipped"] for s in steps), steps


def test_kernels_page_holds_the_measured_table_auto_reads():
    """docs/kernels.md's table of GPU measurements is what ``trickles.kernels.MEASURED`` holds, which ``auto`` reads."""
    from trickles.kernels import measured_markdown

    assert measured_markdown() in _text(ROOT / "docs" / "kernels.md"), (
        "docs/kernels.md's measured table differs from trickles.kernels.MEASURED: paste measured_markdown()'s table"
    )
