"""benchmarks/serving.py counts truthfully: a request is answered only when its stream is whole (no error event, its
``finish_reason``, usage and ``[DONE]`` all there; a non-200 is a failure), a failed request fails the round, and a
text that differs from transformers' is explained from the logits (a near-tie) or fails the run; engine-lora's replies
equal each adapter merged alone, and the tensor-parallel server it starts is always stopped."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
import types

import pytest
import torch

from trickles.infer import speculative

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


def test_engine_lora_replies_equal_each_adapter_merged_alone(tmp_path, capsys):
    """A tiny run of engine and engine-lora: every batch mixes two adapters and the base, the checked replies equal
    each adapter merged into the weights and run alone, and the ratio is reported; a reply from the wrong adapter
    fails the check."""
    out = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--requests", "9", "--concurrency", "3", "--prompt-lens", "8,12"]
    argv += ["--output-lens", "6,9", "--only", "engine", "engine-lora", "--adapters", "2", "--lora-rank", "4"]
    assert bench.main([*argv, "--max-loras", "1", "--lora-checks", "6", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    lora = record["agreement"]["engine_lora"]
    assert lora["equal"] == 6 and len(lora["checked"]) == 6 and not lora["disagreements"]
    assert lora["adapter_changes_reply"] == "4/4"  # the adapters matter: the check is not vacuous
    assert record["ratios"]["engine_lora_over_engine_tokens_per_s"] > 0
    assert "engine-lora agreement: 6/6 checked replies equal" in capsys.readouterr().out

    # the cheapest request of each of the three choices (3, 4, 5), then the next cheapest of the first (0)
    assert bench.lora_checks([("ab", 1), ("a", 9), ("abc", 1), ("a", 1), ("a", 2), ("a", 1)], 2, 4) == [0, 3, 4, 5]
    assert [bench.lora_choice(i, ["x", "y"]) for i in range(4)] == ["x", "y", None, "x"]
    from trickles.models import ModelConfig, build_model

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=260, max_seq_len=32)
    model = build_model(cfg, seed=0).eval()
    adapters = bench.random_adapters(model, 2, 4, seed=0)
    assert len(adapters[0].weights) == 7  # the seven projections of the one block
    greedy = bench.Sampling(max_new_tokens=8, temperature=0)
    requests = [("hello", 8)]
    ids = {
        a.name: bench.decode(bench.merged(model, a), [list(b"hello")], greedy, eos_id=bench.TOK.eos_id)[0].tokens
        for a in adapters
    }
    assert ids["lora0"] != ids["lora1"]
    record, problem = bench.lora_agree(model, requests, {"ids": {0: ids["lora0"]}}, adapters, [0], 1e-6)
    assert problem is None and record["equal"] == 1
    record, problem = bench.lora_agree(model, requests, {"ids": {0: ids["lora1"]}}, adapters, [0], 1e-6)
    assert problem.startswith("engine-lora disagrees with its adapters merged alone on requests [0] without a tie")


def _fake_server(body: str) -> list[str]:
    return [sys.executable, "-c", f"import signal, sys, time\n{body}"]


READY = "print('[trickles] serving /tmp/m on http://127.0.0.1:4321 (POST /v1/completions; 2 ranks)', flush=True)"


def test_the_tensor_parallel_server_is_stopped_however_the_run_ends():
    """continuous-tp's child server: its port read from its line, and stopped (SIGINT; SIGKILL when it ignores that)
    when the run fails, when this process gets SIGTERM, and when it ends; one line when it cannot run."""
    with pytest.raises(RuntimeError, match="^boom"):
        with bench.child_server(_fake_server(f"{READY}\ntime.sleep(120)"), dict(os.environ), 60, grace=5) as (
            port,
            proc,
        ):
            assert port == 4321 and proc.poll() is None
            raise RuntimeError("boom")
    assert proc.returncode is not None
    ignores = f"signal.signal(signal.SIGINT, signal.SIG_IGN)\n{READY}\ntime.sleep(120)"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        with bench.child_server(_fake_server(ignores), dict(os.environ), 60, grace=0.5) as (port, proc):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(300):  # (the handler leaves the block at once; short sleeps, so it runs at once)
                time.sleep(0.1)
    assert proc.returncode == -signal.SIGKILL
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    failing = _fake_server("print('error: --tp 2 needs n_heads divisible by 2'); sys.exit(2)")
    with pytest.raises(RuntimeError, match="^the server exited with status 2 before serving: error: --tp 2 needs"):
        with bench.child_server(failing, dict(os.environ), 60):
            pass
    assert bench.tp_refusal(torch.device("cpu")) is None
    if torch.cuda.device_count() < 2:
        assert bench.tp_refusal(torch.device("cuda")).startswith("continuous-tp: --tp 2 on --device cuda needs 2 GPUs")
    same = {"sent": 1, "answered": 1, "errors": [], "texts": {0: "abc"}}
    assert bench.check({"continuous": same, "continuous-tp": same, "engine-lora": {**same, "texts": {0: "x"}}}) is None
    other = {**same, "texts": {0: "abd"}}
    assert bench.check({"continuous": same, "continuous-tp": other}).startswith("disagreement: continuous-tp answers")


def test_shared_prefix_and_repetitive_workloads_check_their_contestants(tmp_path, capsys, monkeypatch):
    """shared-prefix: every prompt is the one system prompt and a question of its own; engine finds the prefix in its
    cache and engine-noprefix nothing, with the same greedy tokens, and a reference that caches fails the run.
    repetitive: the prompt's continuation is text it holds; engine-ngram's drafts are accepted and its tokens equal
    engine's, and a verifier that keeps every draft fails the run."""
    common = ["--preset", "tiny", "--concurrency", "3", "--block-size", "4", "--max-batch", "4"]
    shared = [*common, "--workload", "shared-prefix", "--prefix-len", "64", "--requests", "6"]
    shared += ["--prompt-lens", "5,9", "--output-lens", "6,9"]
    sizes = dict(seed=0, requests=4, prefix_len=64, prompt_lens="5,9", output_lens="3")
    prompts = [t for t, _ in bench.workload(types.SimpleNamespace(workload="shared-prefix", **sizes))]
    assert len({t[:64] for t in prompts}) == 1 and len({t[64:] for t in prompts}) == 4
    out = tmp_path / "shared.json"
    assert bench.main([*shared, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"engine", "engine-noprefix"}
    assert doc["results"]["engine"]["prefix_hits"] >= 6 * 64 and doc["results"]["engine-noprefix"]["prefix_hits"] == 0
    assert doc["agreement"]["variants"]["engine-noprefix"]["equal_rows"] == 6
    assert {"engine_over_engine_noprefix_tokens_per_s", "engine_over_engine_noprefix_ttft_p99"} <= set(doc["ratios"])
    monkeypatch.setitem(bench.VARIANTS, "engine-noprefix", {})  # a reference that caches after all
    assert bench.main(shared) == 1
    assert "engine-noprefix found" in capsys.readouterr().out
    monkeypatch.undo()

    for prompt, _ in bench.workload(types.SimpleNamespace(workload="repetitive", **sizes)):
        assert prompt[-8:] in prompt[:-8]  # the prompt's end already occurred in it: so did its continuation
    repetitive = [
        *common,
        "--workload",
        "repetitive",
        "--requests",
        "4",
        "--output-lens",
        "24,40",
        "--train-steps",
        "2",
    ]
    out = tmp_path / "repetitive.json"
    assert bench.main([*repetitive, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    ngram = doc["results"]["engine-ngram"]
    assert set(doc["results"]) == {"engine", "engine-ngram"} and 0 < ngram["accepted"] < ngram["drafted"]
    assert doc["agreement"]["variants"]["engine-ngram"]["equal_rows"] == 4
    assert doc["ratios"]["engine_ngram_over_engine_tokens_per_s"] > 0
    assert "trained to recite code: 2 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # (the training is the repetitive workload's)
        bench.main([*shared, "--train-steps", "2"])

    def keeps_every_draft(top_at, drafts):
        return [*drafts, top_at(len(drafts))]

    monkeypatch.setattr(speculative, "accept_greedy", keeps_every_draft)
    assert bench.main(repetitive) == 1
    assert "engine-ngram disagrees with engine on requests" in capsys.readouterr().out
