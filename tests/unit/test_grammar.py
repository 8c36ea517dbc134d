"""Structured output in the continuous-batching engine (trickles/infer/grammar.py): sampled replies of a random tiny
model under JSON schemas validate and ``json_object`` replies parse, for the byte tokenizer, a byte-level BPE and a
sentencepiece-style BPE; free requests sharing the batch get the tokens they get alone; preemption, ``n`` choices,
the end of a grammar, log-probabilities under the mask, and the refusals."""

from __future__ import annotations

import json
import sys

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar", exc_type=ImportError)  # the grammar extra (CI installs it)
jsonschema = pytest.importorskip("jsonschema", exc_type=ImportError)

from trickles.data import ByteTokenizer, train_bpe  # noqa: E402
from trickles.data.tokenizers import HFTokenizer  # noqa: E402
from trickles.infer import Sampling, decode  # noqa: E402
from trickles.infer.engine import Engine, EngineConfig  # noqa: E402
from trickles.infer.grammar import GrammarError, Grammars, JsonFormat, vocabulary_bytes  # noqa: E402
from trickles.infer.static import StaticBackend  # noqa: E402
from trickles.models import ModelConfig, build_model  # noqa: E402

BYTE = ByteTokenizer()
STEPS = 3000  # iterations any test here needs, many times over
SCHEMAS = {
    "object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
    },
    "enum": {"enum": ["red", "green", "blue"]},
    "integers": {"type": "array", "items": {"type": "integer"}},
}
CORPUS = [
    'The quick brown fox jumps over the lazy dog. {"name": "Ada", "age": 36, "ok": true} [1, 22, 333]\n',
    "Zürich, São Paulo and 東京 are cities;\tnumbers: 0 -7 42 1e3, true false null\n",
    'def f(x):\n    return {"key": [x, "value"], "nested": {"a": null}}\n',
] * 20


def _sentencepiece_style(vocab: int) -> HFTokenizer:
    """A Llama-2-style tokenizer trained here: ``▁`` for spaces, byte fallback tokens ``<0x00>..<0xFF>`` (ordinary
    ids 3..258), specials ``<unk> <s> </s>``, a decoder that drops the text's first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False))
    spec = json.loads(tk.to_str())
    spec["added_tokens"] = spec["added_tokens"][:3]
    return HFTokenizer(Tokenizer.from_str(json.dumps(spec)), "</s>", "hf", "sentencepiece")


@pytest.fixture(scope="module")
def tokenizers():
    return {"byte": BYTE, "bpe": train_bpe(CORPUS, 420), "sentencepiece": _sentencepiece_style(420)}


def _model(vocab: int = 260, context: int = 512):
    cfg = ModelConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=vocab, max_seq_len=context
    )
    return build_model(cfg, seed=0).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _valid(text: str, schema: dict | None) -> bool:
    try:
        value = json.loads(text)
        if schema is None:
            return isinstance(value, dict)
        jsonschema.validate(value, schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _structured(schema, tokens=300, **kw) -> Sampling:
    return Sampling(max_new_tokens=tokens, temperature=1.0, response_format=JsonFormat.of(schema), **kw)


def test_twenty_sampled_replies_under_each_schema_validate_and_json_objects_parse(model):
    """One batch: 20 sampled choices under each of the three schemas and 20 under ``json_object``. Every schema reply
    ends by itself (end-of-text once the value is whole) and validates; a ``json_object`` reply that ends by itself
    parses as an object (a random model's unconstrained strings and nesting may run past the 200-token budget: those
    report ``length``, and most end first). Without the grammar the same model writes no JSON at all."""
    engine = Engine(model, BYTE, EngineConfig(max_batch=80, block_size=16, num_blocks=1200))
    prompt = BYTE.encode("reply: ")
    requests = {name: engine.submit(prompt, _structured(s, seed=1), 20) for name, s in SCHEMAS.items()}
    loose = engine.submit(prompt, _structured(None, 200, seed=2), 20)
    free = engine.submit(prompt, Sampling(max_new_tokens=40, temperature=1.0, seed=1), 20)
    engine.run_until_idle(max_steps=STEPS)
    for name, request in requests.items():
        assert all(c.finish_reason == "stop" for c in request.result), name
        assert all(_valid(c.text, SCHEMAS[name]) for c in request.result), [c.text for c in request.result]
    assert len({c.text for c in requests["object"].result}) == 20  # sampled: twenty different replies
    ended = [c for c in loose.result if c.finish_reason == "stop"]
    assert len(ended) >= 12 and all(_valid(c.text, None) for c in ended), [c.text for c in loose.result]
    assert all(len(c.tokens) == 200 for c in loose.result if c.finish_reason == "length")
    assert not any(_valid(c.text, None) for c in free.result)


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_byte_level_and_sentencepiece_tokenizers_give_valid_replies(tokenizers, kind):
    """Multi-byte tokens, byte-fallback tokens and ``▁`` spaces: 8 sampled replies under the object schema and the
    array of integers validate, their text being the tokenizer's decoding of their tokens."""
    tok = tokenizers[kind]
    engine = Engine(_model(tok.vocab_size), tok, EngineConfig(max_batch=16, block_size=16, num_blocks=300))
    prompt = tok.encode("Answer in JSON: ")
    requests = {name: engine.submit(prompt, _structured(SCHEMAS[name], seed=3), 8) for name in ("object", "integers")}
    engine.run_until_idle(max_steps=STEPS)
    for name, request in requests.items():
        for c in request.result:
            assert c.finish_reason == "stop" and _valid(c.text, SCHEMAS[name]), (name, c.text)
            assert c.text == tok.decode(c.tokens)


@pytest.mark.parametrize("kind", ["byte", "bpe", "sentencepiece"])
def test_the_vocabulary_bytes_spell_the_text_the_tokens_encode(tokenizers, kind):
    """Joined, the bytes :func:`vocabulary_bytes` gives each token of an encoding are the text's UTF-8 (after the
    space a sentencepiece-style tokenizer puts first); the specials are empty."""
    tok = tokenizers[kind]
    table, special = vocabulary_bytes(tok)
    text = 'Zürich {"a": [1, -2]}\n\tend 東京 \x07'
    first = b" " if kind == "sentencepiece" else b""
    assert b"".join(table[i] for i in tok.encode(text)) == first + text.encode("utf-8")
    assert tok.eos_id in special and all(table[i] == b"" for i in special)


def test_free_requests_in_a_mixed_batch_get_the_tokens_they_get_alone(model):
    """Greedy, seeded and penalized free requests (one with logprobs) give the same tokens, text and
    log-probabilities whether they run alone or in one batch with constrained requests of every schema."""
    settings = [
        Sampling(max_new_tokens=24, temperature=0.0),
        Sampling(max_new_tokens=24, temperature=0.9, seed=7, logprobs=3),
        Sampling(max_new_tokens=24, temperature=1.0, seed=8, top_k=20, presence_penalty=0.5),
    ]
    prompts = [BYTE.encode(p) for p in ("def ", "The answer", "{")]

    def run(with_constrained: bool):
        engine = Engine(model, BYTE, EngineConfig(max_batch=16, block_size=8, num_blocks=400))
        free = []
        for i, (p, s) in enumerate(zip(prompts, settings)):
            if with_constrained:
                engine.submit(p, _structured(list(SCHEMAS.values())[i], 30, seed=i), 2)
            free.append(engine.submit(p, s))
        engine.run_until_idle(max_steps=STEPS)
        return [r.result[0] for r in free]

    mixed, alone = run(True), run(False)
    assert [c.tokens for c in mixed] == [c.tokens for c in alone] and [c.text for c in mixed] == [c.text for c in alone]
    got, want = ([lp.logprob for lp in c.logprobs] for c in (mixed[1], alone[1]))
    assert got == pytest.approx(want, abs=1e-5)  # (batched matmuls round differently: the tokens are the same)


def test_preempted_constrained_sequences_keep_their_grammar_state(model):
    """In a pool of 30 blocks of 4 (room for one whole reply, not four), constrained sequences are preempted and
    recomputed (asserted); each choice's tokens equal those of a pool with room for all, and validate."""

    def run(blocks: int):
        engine = Engine(model, BYTE, EngineConfig(max_batch=4, block_size=4, num_blocks=blocks, prefill_chunk=16))
        requests = [
            engine.submit(BYTE.encode(f"q{i}: "), _structured(SCHEMAS["object"], 110, seed=i), 2) for i in (0, 1)
        ]
        engine.run_until_idle(max_steps=STEPS)
        preempted = sum(s.preemptions for r in requests for s in r.sequences)
        return [c for r in requests for c in r.result], preempted

    tight, preempted = run(30)
    roomy, none = run(400)
    assert preempted > 0 and none == 0
    assert [c.tokens for c in tight] == [c.tokens for c in roomy]
    assert all(_valid(c.text, SCHEMAS["object"]) for c in tight if c.finish_reason == "stop")
    assert sum(c.finish_reason == "stop" for c in tight) >= 3


def test_a_whole_value_allows_only_the_end_and_logprobs_are_those_of_the_masked_distribution(model):
    """After ``"red"`` the enum's grammar allows only end-of-text. The first token of an enum reply can only be
    ``"``: its log-probability is 0 and the other top tokens', forbidden, -9999 (as vLLM reports a masked token); a
    reply cut by its budget reports ``length``."""
    grammars = Grammars(BYTE, 260)
    (matcher,) = grammars.matchers(JsonFormat.of(SCHEMAS["enum"]), 1)
    for b in b'"red"':
        assert matcher.accept(b)
    bitmask = torch.zeros(1, 9, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    allowed = [t for t in range(260) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == [BYTE.eos_id] and matcher.complete
    engine = Engine(model, BYTE, EngineConfig(max_batch=4, block_size=8, num_blocks=64))
    enum = engine.submit(BYTE.encode("color: "), _structured(SCHEMAS["enum"], seed=0, logprobs=4))
    cut = engine.submit(BYTE.encode("person: "), _structured(SCHEMAS["object"], 5, seed=0))
    engine.run_until_idle(max_steps=STEPS)
    first = enum.result[0].logprobs[0]
    assert first.token == ord('"') and first.logprob == 0.0
    assert [v for t, v in first.top if t != first.token] == [-9999.0] * 3  # (4 most likely, the first "\"")
    assert enum.result[0].text in ('"red"', '"green"', '"blue"') and enum.result[0].finish_reason == "stop"
    assert cut.result[0].finish_reason == "length" and len(cut.result[0].tokens) == 5


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 4}, None])
def test_strings_take_what_json_allows_and_nothing_else(schema):
    """A string (plain, length-limited, or a ``json_object`` key) takes any character but a control character
    (RFC 8259: escaped) and a surrogate code point (not UTF-8), which xgrammar's own grammars let through."""
    grammars = Grammars(BYTE, 260)
    prefix = b'{"k":' if schema is None else b""
    for body, valid in ((b'"a\xc3\xa9 z"', True), (b'"\x01"', False), (b'"\xed\xb9\xa5"', False)):
        (matcher,) = grammars.matchers(JsonFormat.of(schema), 1)
        assert all(matcher.accept(b) for b in prefix + body) == valid, body


def test_refusals_say_what_is_wrong_on_one_line(model, monkeypatch):
    """A schema the library cannot compile, a missing library, the plain decoder, the static batcher and speculative
    decoding: each a ValueError of one line at submission. A format is compiled once however often it is asked for."""
    engine = Engine(model, BYTE, EngineConfig(max_batch=4, block_size=8, num_blocks=64))
    with pytest.raises(
        GrammarError, match=r"^response_format: the JSON schema cannot be used: .*Unsupported type"
    ) as e:
        engine.submit([1], _structured({"type": "colour"}))
    assert "\n" not in str(e.value)
    for _ in range(2):
        engine.submit([1], _structured(SCHEMAS["enum"], 1), 3)
    engine.submit([1], _structured(None, 1))
    assert engine.grammars.compiled == 2
    engine.run_until_idle(max_steps=STEPS)
    with pytest.raises(ValueError, match="response_format: only the continuous-batching engine"):
        decode(model, [[1]], _structured(None, 2))
    with pytest.raises(ValueError, match="response_format: the static batcher does not apply these"):
        StaticBackend(model, BYTE, 2, 0.01).submit([1], _structured(None), on_event=None, on_finish=None)
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(GrammarError, match=r"needs the xgrammar library: pip install xgrammar$"):
        Engine(model, BYTE, EngineConfig(max_batch=2, num_blocks=8)).submit([1], _structured(None))
    monkeypatch.undo()
    spec = Engine(model, BYTE, EngineConfig(max_batch=2, num_blocks=8, speculative="ngram"))
    with pytest.raises(ValueError, match="does not combine with speculative decoding; serve without --speculative"):
        spec.submit([1], _structured(None))
