"""``trickles.testing.run_command``, which the end-to-end tests use in place of ``subprocess.run``: a command forked
from the preloaded forkserver sees what a fresh interpreter would (arguments, working directory, environment,
``sys.path``, thread count, standard streams, exit status), and a variable read at import time that differs from
the forkserver's sends it to a fresh interpreter after all."""

import json
import os
import subprocess
import sys

from trickles.testing import run_command

PROBE = """\
import json, os, sys
fresh = "torch" not in sys.modules
import torch
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path": sys.path, "threads": torch.get_num_threads(),
                  "env": {k: os.environ.get(k) for k in ("TRICKLES_PROBE", "TORCHINDUCTOR_PROBE")},
                  "main": __name__, "out": sys.stdout.encoding, "fresh": fresh}))
print("caf\\u00e9 to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_command_sees_what_a_fresh_interpreter_sees(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    extra = tmp_path / "extra"
    env = {
        **os.environ,
        "TRICKLES_PROBE": "yes",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(extra),
        "PYTHONIOENCODING": "utf-8",
    }
    cmd = [sys.executable, str(script), "3", "--flag"]
    forked = run_command(cmd, cwd=work, env=env, timeout=60)
    fresh = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr) == (3, "caf\u00e9 to stderr\n")
    seen, expected = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert seen.pop("fresh") is False and expected.pop("fresh") is True  # forked: torch was imported already
    assert seen == expected
    assert (
        seen["path"][:2] == [str(tmp_path), str(extra)]
        and seen["threads"] == 1
        and seen["env"]["TRICKLES_PROBE"] == "yes"
    )

    # a variable that torch read when the forkserver imported it: only a fresh interpreter sees it as a fresh one would
    env["TORCHINDUCTOR_PROBE"] = "1"
    (tmp_path / "fresh.py").write_text('import sys\nprint("torch" in sys.modules)\n')
    fresh_again = run_command([sys.executable, str(tmp_path / "fresh.py")], cwd=work, env=env, timeout=60)
    assert (fresh_again.returncode, fresh_again.stdout) == (0, "False\n"), fresh_again.stderr

    # trickles' own entry point, its one-line refusal and status
    r = run_command([sys.executable, "-m", "trickles", "train", "--set", "model.preset=nope"], timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith("error: unknown model.preset 'nope'"), r.stderr


RANKS_PROBE = """\
import json, os, sys
from trickles.launch import launch


def report():  # one write of the whole line: the two ranks share the pipe, and a line written in parts can interleave
    line = json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "cwd": os.getcwd(),
                       "path": sys.path, "argv": sys.argv, "probe": os.environ.get("TRICKLES_PROBE"),
                       "main": sys.modules["__main__"].__name__})
    os.write(sys.stdout.fileno(), (line + "\\n").encode())


if __name__ == "__main__":
    sys.exit(launch(report, (), 2, quiet=True))
"""


def test_ranks_a_forked_command_launches_see_what_a_fresh_commands_ranks_see(tmp_path):
    """The launcher's forkserver in a forked command is a fork of the command (no second interpreter importing the
    trainer); its ranks see the arguments, directory, path and environment that ranks of a fresh command see."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_PROBE)
    env = {**os.environ, "TRICKLES_PROBE": "ranks", "PYTHONPATH": str(tmp_path / "extra")}
    cmd = [sys.executable, str(script), "--flag"]
    forked = run_command(cmd, cwd=tmp_path, env=env, timeout=120)
    fresh = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    seen, expected = (sorted(map(json.loads, r.stdout.splitlines()), key=lambda d: d["rank"]) for r in (forked, fresh))
    assert [d["rank"] for d in seen] == ["0", "1"] and seen[0]["probe"] == "ranks" and seen[0]["argv"][1:] == ["--flag"]
    assert seen == expected
