"""``trickles serve --speculative``: the server with n-gram speculation on loopback answers greedy completions (plain
and streamed) with plain decoding's text and counts drafts on ``/metrics``; the command line builds the engine's
speculative settings and loads the draft model; its refusals are one line each."""

from __future__ import annotations

import http.client
import json

import pytest
from helpers import cli_here

pytest.importorskip("fastapi", exc_type=ImportError)  # the serve extra (CI installs it: a skip there fails)
pytest.importorskip("uvicorn", exc_type=ImportError)

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer import Sampling, decode  # noqa: E402
from trickles.infer.engine import EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.infer.server import create_app  # noqa: E402
from trickles.models import ModelConfig, build_model  # noqa: E402

TOK = ByteTokenizer()


def _model(layers=2, vocab=260, seed=0):
    cfg = ModelConfig(
        n_layers=layers, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=vocab, max_seq_len=128
    )
    return build_model(cfg, seed=seed).eval()


def _post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read()


def test_the_server_speculates_with_ngrams_and_answers_plain_decodings_text():
    model = _model()
    config = EngineConfig(max_batch=4, block_size=4, num_blocks=40, speculative="ngram", num_speculative_tokens=3)
    app = create_app(model, TOK, name="tiny", engine_config=config)
    background = BackgroundServer(app)
    try:
        prompts = ["abcabcabcab", "def f(x): return x\ndef g(x): return x\ndef ", "la la la la la"]
        for prompt in prompts:
            [alone] = decode(
                model,
                [TOK.encode(prompt)],
                Sampling(max_new_tokens=24, temperature=0),
                eos_id=TOK.eos_id,
                tokenizer=TOK,
            )
            status, body = _post(background.port, {"prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert status == 200, body
            choice = json.loads(body)["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (alone.text, alone.finish_reason)
            status, body = _post(
                background.port, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
            )
            chunks = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == alone.text
        conn = http.client.HTTPConnection("127.0.0.1", background.port, timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        background.stop()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    spec = app.state.engine.spec
    assert float(values["trickles_spec_decode_draft_tokens_total"]) == spec.drafted > 0
    assert float(values["trickles_spec_decode_accepted_tokens_total"]) == spec.accepted


def test_serve_builds_the_speculative_settings_and_loads_the_draft(tmp_path, monkeypatch):
    import trickles.cli.serve as serve
    import trickles.infer.listen as listen

    target, draft = _model(), _model(layers=1, seed=1)
    loaded = {str(tmp_path / "target"): target, str(tmp_path / "draft"): draft}
    for d in loaded:
        (tmp_path / d).mkdir()
    monkeypatch.setattr(serve, "context_length", lambda path: 128)
    monkeypatch.setattr(serve, "check_checkpoint", lambda *a: None)
    monkeypatch.setattr(serve, "check_layout", lambda args: None)  # one process
    monkeypatch.setattr(serve, "load_model", lambda path, *a, **k: (loaded[path], TOK, {}))
    seen = {}
    monkeypatch.setattr(listen, "serve", lambda *a, **k: seen.update(k))
    r = cli_here(
        "serve", tmp_path / "target", "--device", "cpu", "--speculative", "draft", "--draft", tmp_path / "draft"
    )
    assert r.returncode == 0, r.stderr
    config = seen["engine_config"]
    assert (config.speculative, config.num_speculative_tokens, config.draft_model) == ("draft", 4, draft)
    r = cli_here(
        "serve", tmp_path / "target", "--device", "cpu", "--speculative", "ngram", "--ngram-max", "3",
        "--num-speculative-tokens", "6",
    )  # fmt: skip
    config = seen["engine_config"]
    assert r.returncode == 0 and (config.speculative, config.ngram_min, config.ngram_max) == ("ngram", 1, 3)
    assert config.num_speculative_tokens == 6 and config.draft_model is None

    loaded[str(tmp_path / "draft")] = _model(layers=1, vocab=300)
    r = cli_here(
        "serve", tmp_path / "target", "--device", "cpu", "--speculative", "draft", "--draft", tmp_path / "draft"
    )
    assert (r.returncode, r.stderr) == (
        2,
        f"error: --draft {tmp_path / 'draft'}: its vocabulary has 300 rows, the served model's 260: a draft must "
        "have the served model's vocabulary size\n",
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--speculative", "draft"], "--speculative draft needs --draft DIR (a smaller model with the same tokenizer)"),
        (["--draft", "{tmp}"], "--draft applies to --speculative draft; add it or drop --draft"),
        (["--num-speculative-tokens", "2"], "--num-speculative-tokens applies with --speculative ngram or draft"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be"),
        (["--ngram-max", "3"], "--ngram-min and --ngram-max apply to --speculative ngram; add it or drop them"),
        (["--speculative", "ngram", "--ngram-min", "5"], "--ngram-min 5 is above --ngram-max 4"),
        (["--speculative", "ngram", "--batching", "static"], "--speculative applies to --batching continuous only"),
    ],
)
def test_serve_refuses_speculative_flags_without_what_they_apply_to(tmp_path, args, message):
    r = cli_here("serve", tmp_path, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith(f"error: {message}"), r.stderr
    assert r.stderr.count("\n") == 1
