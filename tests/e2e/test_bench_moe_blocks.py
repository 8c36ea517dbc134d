"""``benchmarks/moe_blocks.py`` at a tiny shape: both blocks agree with transformers' (the check that gates the
timing), every contestant is timed, and the JSON holds the ratios the README records."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", exc_type=ImportError)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe_blocks  # noqa: E402


def test_moe_blocks_agree_and_time(tmp_path, capsys):
    path = tmp_path / "moe_blocks.json"
    shape = ["--seq", "16", "--d-model", "32", "--ffn", "16", "--experts", "8", "--top-k", "2", "--groups", "4"]
    args = [*shape, "--topk-groups", "2", "--steps", "1", "--warmup", "0", "--impls", "grouped_mm,eager"]
    assert moe_blocks.main([*args, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert sorted(doc["blocks"]) == ["deepseek", "qwen3"]
    for kind, block in doc["blocks"].items():
        assert [row[-1] for row in block["checks"]] == ["ok", "ok"], block["checks"]
        assert sorted(block["ratio"]) == [f"hf {kind} (eager)", f"hf {kind} (grouped_mm)"]
        assert block["peer"] in block["ratio"] and all(math.isfinite(r) for r in block["ratio"].values())
    assert "target ours/peer <= 0.95x:  deepseek: ours/hf deepseek" in capsys.readouterr().out
