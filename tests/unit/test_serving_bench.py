"""benchmarks/serving.py counts truthfully: a request is answered only when its stream is whole (no error event, its
``finish_reason``, usage and ``[DONE]`` all there; a non-200 is a failure), a failed request fails the round, and a
text that differs from transformers' is explained from the logits (a near-tie) or fails the run."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("fastapi", exc_type=ImportError)  # the benchmark imports the server (the serve extra)

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serving.py")
_spec = importlib.util.spec_from_file_location("serving_benchmark", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _events(*chunks, done=True) -> list[bytes]:
    lines = []
    for c in chunks:
        lines += [f"data: {json.dumps(c)}\n".encode(), b"\n"]
    return lines + ([b"data: [DONE]\n", b"\n"] if done else [])


def _choice(text, finish=None):
    return {"choices": [{"text": text, "index": 0, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def test_only_a_whole_stream_is_answered():
    clock = iter([1.5, 9.0]).__next__
    first, text, tokens = bench.read_stream(
        _events(_choice("ab"), _choice("c", "length"), USAGE), started=1.0, clock=clock
    )
    assert (first, text, tokens) == (0.5, "abc", 3)
    error = {"error": {"message": "decoding failed: boom", "type": "server_error"}}
    cases = {
        "error event: decoding failed: boom": _events(_choice("ab"), error),
        "truncated stream: it ended without finish_reason, usage, [DONE]": _events(_choice("ab"), done=False),
        "truncated stream: it ended without [DONE]": _events(_choice("ab", "stop"), USAGE, done=False),
        "truncated stream: it ended without finish_reason": _events(_choice("ab"), USAGE),
        "truncated stream: it ended without usage": _events(_choice("ab", "stop")),
    }
    for words, lines in cases.items():
        with pytest.raises(RuntimeError, match=f"^{words.replace('[', '.').replace(']', '.')}"):
            bench.read_stream(lines, started=0.0)


def test_a_failed_request_is_not_answered_and_fails_the_round():
    class Args:
        rate, warmup, concurrency, time_limit, seed = 0.0, 0, 2, 60.0, 0

    def send(i):
        if i == 1:
            bench.read_stream(_events({"error": {"message": "the server is shutting down"}}), 0.0)
        return 0.1, f"text {i}", 2

    record = bench.drive(Args, [("p", 2)] * 3, send)
    assert record["sent"] == 3 and record["answered"] == 2 and set(record["texts"]) == {0, 2}
    assert "error event: the server is shutting down" in record["errors"][0]
    assert bench.check({"continuous": record}).startswith("requests lost or failed")


def test_a_difference_from_transformers_is_a_near_tie_or_fails_the_run():
    from trickles.models import ModelConfig, build_model

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=260, max_seq_len=32)
    model = build_model(cfg, seed=0).eval()
    prompt = list(b"abc")
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
    best, second = logits.topk(2).indices.tolist()
    gap = float(logits[best] - logits[second])
    tie, why = bench.explain(model, prompt, [best, 7], [second, 7], tolerance=gap * 1.01)
    assert tie and f"ours {best}" in why and f"transformers {second}" in why and "near-tie" in why
    tie, why = bench.explain(model, prompt, [best], [second], tolerance=gap / 2)
    assert not tie and "no tie" in why
    ours = {"texts": {0: "x", 1: "y"}, "ids": {0: [best], 1: [5]}}
    theirs = {"texts": {0: "z", 1: "y"}, "ids": {0: [second], 1: [5]}}
    requests = [("abc", 1), ("abc", 1)]
    record, problem = bench.agree(model, requests, {"engine": ours, "transformers": theirs}, gap * 1.01)
    assert problem is None and record["near_ties"] == [0] and record["transformers_equal_rows"] == 1
    record, problem = bench.agree(model, requests, {"engine": ours, "transformers": theirs}, gap / 2)
    assert problem == "transformers disagrees with us on requests [0] without a tie" and record["disagreements"] == [0]
