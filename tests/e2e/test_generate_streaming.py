"""``trickles generate --device-budget-gb``: the same text as the resident model, and one-line errors for bad budgets;
the serving engine on streamed and int8 models."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
from helpers import cli_here

from trickles.compress.quantize import quantize_model
from trickles.data.tokenizers import ByteTokenizer
from trickles.infer import Sampling, decode
from trickles.infer.engine import Engine, EngineConfig
from trickles.infer.streaming import block_bytes, kv_cache_bytes, load_streaming, save_for_inference
from trickles.models.config import ModelConfig
from trickles.models.presets import apply_preset
from trickles.models.transformer import build_model
from trickles.testing import run_command
from trickles.train.load import load_for_inference


def _run(*args):
    return run_command(
        [sys.executable, "-m", "trickles", "generate", *args],
        text=False,
        timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONIOENCODING="utf-8"),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dataclasses.replace(apply_preset(ModelConfig(), "tiny"), n_layers=6, vocab_size=257, max_seq_len=64)
    model = build_model(cfg, seed=5)
    path = str(tmp_path_factory.mktemp("stream") / "ckpt")
    save_for_inference(model, ByteTokenizer(), path)
    others = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("layers.")) + sum(
        b.numel() * 4 for b in model.buffers()
    )
    # every block streamed: the embeddings, head and KV cache (2 samples x 64 positions) plus two buffers
    least = others + kv_cache_bytes(cfg, 2, 64) + 2 * block_bytes(model.layers["0"])
    return path, least


def test_streamed_text_equals_resident_text(checkpoint):
    path, least = checkpoint
    common = [
        path,
        "--prompt",
        "def f(",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0.8",
        "--num-samples",
        "2",
        "--seed",
        "11",
        "--device",
        "cpu",
    ]
    resident = _run(*common)
    streamed = _run(*common, "--device-budget-gb", f"{least / 1e9:.9f}")
    assert resident.returncode == 0 and streamed.returncode == 0, streamed.stderr.decode(errors="replace")
    assert streamed.stdout == resident.stdout
    assert ": 6 of 6 blocks stream (blocks 0, 1, 2, 3, 4, 5)" in streamed.stderr.decode()
    assert resident.stdout.decode().count("--- sample") == 2


@pytest.mark.parametrize(
    "value,needle",
    [
        ("0", "--device-budget-gb must be a positive number of GB, got 0"),
        ("-2", "--device-budget-gb must be a positive number of GB, got -2"),
        ("nan", "--device-budget-gb must be a positive number of GB, got nan"),
        ("0.000001", "too small for this model: streaming every block still needs"),
    ],
)
def test_bad_budget_is_one_line_exit_2(checkpoint, value, needle):
    args = (checkpoint[0], "--device-budget-gb", value, "--max-new-tokens", "4", "--device", "cpu")
    r = _run(*args) if value == "0" else cli_here("generate", *args)  # one case through a real process
    err = r.stderr.decode() if isinstance(r.stderr, bytes) else r.stderr
    assert r.returncode == 2 and not r.stdout
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("int8", [None, "full"], ids=["fp32", "int8-full"])
def test_the_serving_engine_runs_streamed_and_int8_models(checkpoint, int8):
    """``trickles serve --device-budget-gb`` (every block streamed) and ``--int8`` run on the continuous-batching
    engine: three requests of different lengths decoded together give the tokens each gets alone from the same model
    (and, streamed, the resident model's tokens)."""
    path, least = checkpoint
    resident, tok, _ = load_for_inference(path, "cpu")
    if int8:
        quantize_model(resident, mode=int8)
    models = [resident] if int8 else [resident, load_streaming(path, "cpu", least, batch=2, max_len=64)[0]]
    prompts = [tok.encode(t) for t in ("def f(", "import os\n", "x")]
    alone = [
        decode(resident, [p], Sampling(max_new_tokens=12, temperature=0), eos_id=tok.eos_id)[0].tokens for p in prompts
    ]
    for model in models:
        engine = Engine(model, tok, EngineConfig(max_batch=3, block_size=8))
        requests = [engine.submit(p, Sampling(max_new_tokens=12, temperature=0)) for p in prompts]
        engine.run_until_idle(max_steps=200)  # a few dozen needed: an engine still busy after 200 fails, not hangs
        assert [r.result[0].tokens for r in requests] == alone
        assert engine.pool.used == 0
