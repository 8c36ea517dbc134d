"""``benchmarks/families.py`` end to end at a tiny size: both parts (the Qwen3-shaped training step against
transformers' ``Qwen3ForCausalLM``, importing a sharded llama-shaped directory against ``from_pretrained``), one timed
round each, the agreement checks included, then the tables and the JSON read back. Its arguments say only sizes and
where to write, as ``test_benchmarks.py``'s do."""

import json
import os
import re
import sys
from pathlib import Path

from trickles.testing import run_command

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--layers", "1", "--seq", "16", "--vocab", "512", "--steps", "1", "--warmup", "0"]
TINY_IMPORT = ["--import-layers", "1", "--import-vocab", "512", "--shard-size", "20MB", "--rounds", "1"]


def test_families_benchmark_runs_both_parts_at_a_tiny_size(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    out = tmp_path / "families.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "families.py"), *TINY, *TINY_IMPORT, "--json", str(out)]
    run = run_command(cmd, cwd=ROOT, env=env, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(
        r"agreement: fp32 logits \|\|ours - HF\|\| / \|\|HF\|\| \S+ \(tolerance 0.0001\); .*: OK", run.stdout
    )
    assert re.search(r"ours/transformers step time \(paired\): \d+\.\d+x", run.stdout)
    assert re.search(r"ours/transformers import time \(paired\): \d+\.\d+x", run.stdout)
    assert "weights equal: True" in run.stdout

    doc = json.loads(out.read_text())
    step, imported = doc["step"], doc["import"]
    assert step["check"]["ok"] and step["model"]["n_layers"] == 1 and step["model"]["vocab_size"] == 512
    assert step["ratio"] > 0 and {len(r["times"]) for r in step["results"].values()} == {1}
    # sharded by save_pretrained: an index beside two or more shards
    assert "model.safetensors.index.json" in imported["files"]
    assert sum(f.endswith(".safetensors") for f in imported["files"]) >= 2
    assert imported["weights_equal"] and imported["ratio"] > 0
