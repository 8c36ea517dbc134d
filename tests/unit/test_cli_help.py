"""The ``trickles`` command's help and structure: every option says what it does and what it is when left out, and the
command package stays one module per subcommand that imports the library only when its command runs."""

import argparse
import subprocess
import sys

import pytest

from trickles.cli import COMMANDS, _parser


def _commands():
    """``[(command words, parser)]`` for every command and subcommand of the CLI."""
    out = []

    def walk(parser, words):
        out.append((words, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*words, name])

    walk(_parser(), [])
    return out


FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction, argparse._SubParsersAction)


@pytest.mark.parametrize("words,parser", _commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_option_gives_its_meaning_and_default(words, parser):
    text = parser.format_help()  # a stray % in a help string fails here
    assert parser.description, f"`trickles {' '.join(words)} --help` does not say what the command does"
    for action in parser._actions:
        if isinstance(action, FLAGS):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help, f"trickles {' '.join(words)} {name} has no help"
        if action.option_strings and not action.required:
            assert "default" in action.help, f"trickles {' '.join(words)} {name}: its help does not give the default"
            assert action.option_strings[0] in text


def test_every_command_has_its_own_module():
    assert list(COMMANDS) == [
        "train",
        "generate",
        "serve",
        "eval",
        "memory",
        "bench",
        "config",
        "plan",
        "checkpoint",
        "compress",
    ]
    for name, module in COMMANDS.items():
        assert module.__name__ == f"trickles.cli.{name}" and callable(module.add_parser) and callable(module.run)


def test_the_command_imports_no_more_of_the_library_than_the_package_does():
    code = (
        "import sys, trickles; before = set(sys.modules); import trickles.cli; "
        "print(sorted(m for m in set(sys.modules) - before if not m.startswith('trickles.cli')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"importing trickles.cli imports {r.stdout.strip()}: import them inside run()"
