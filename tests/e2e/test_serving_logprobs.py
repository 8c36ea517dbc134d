"""Logprobs, echo and OpenAI's penalties over HTTP, checked against transformers: a tiny ``LlamaForCausalLM`` built by
transformers and saved, read back by ``load_hf`` and served by the continuous-batching server; the official ``openai``
client parses every answer. The log-probabilities the server returns, for completions and chat, greedy and sampled,
plain and streamed, the echoed prompt's included, equal transformers' log-softmax over the whole sequence within
1e-5 (fp32); ``top_logprobs`` are sorted and hold the chosen token; out-of-range values and unknown fields get a 400.

The tokenizer is the byte tokenizer decoding each byte as one Latin-1 character, so every token's text names its id
and the test can rebuild the sequence transformers scores from the answer alone."""

from __future__ import annotations

import http.client
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi", exc_type=ImportError)
pytest.importorskip("uvicorn", exc_type=ImportError)
openai = pytest.importorskip("openai", exc_type=ImportError)
transformers = pytest.importorskip("transformers")

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer.chat import plain_template  # noqa: E402
from trickles.infer.engine import EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.infer.server import create_app  # noqa: E402
from trickles.models.hf import load_hf  # noqa: E402

EOS = "<|endoftext|>"


class Latin1Tokenizer(ByteTokenizer):
    """Bytes as ids, each decoded as one Latin-1 character (a token's text names its id)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1"))

    def decode(self, ids) -> str:
        return bytes(i for i in (int(x) for x in ids) if 0 <= i < 256).decode("latin-1")


TOK = Latin1Tokenizer()


def _id(text: str) -> int:
    return TOK.eos_id if text == EOS else ord(text)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "tiny-llama"
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(root)
    model = load_hf(root).eval()
    config = EngineConfig(max_batch=8, block_size=4, num_blocks=64, prefill_chunk=8)  # prompts prefill in chunks
    background = BackgroundServer(create_app(model, TOK, name="tiny", engine_config=config))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{background.port}/v1", api_key="x", max_retries=0, timeout=60)
    yield hf, client, background.port
    background.stop()


@torch.no_grad()
def _reference(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_top(top: list[tuple[int, float]], chosen: int, row: torch.Tensor, n: int) -> None:
    """Sorted, the chosen token held, the ``n`` most likely of ``row`` first, every value within 1e-5."""
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True) and chosen in [t for t, _ in top]
    assert [t for t, _ in top][:n] == row.topk(n).indices.tolist() and len(top) in (n, n + 1)
    assert max(abs(v - float(row[t])) for t, v in top) < 1e-5


def _check_completion(hf, prompt: str, lp, text: str, n: int, echo: bool) -> None:
    ids = [_id(t) for t in lp.tokens]
    full = ids if echo else list(prompt.encode("latin-1")) + ids
    ref = _reference(hf, full)
    first = 1 if echo else len(prompt)  # the first token scored
    if echo:
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and text.startswith(prompt)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert "".join(lp.tokens) == text and len(ids) > first - (0 if echo else len(prompt))
    for i in range(first if echo else 0, len(ids)):
        row = ref[(i if echo else len(prompt) + i) - 1]
        assert abs(lp.token_logprobs[i] - float(row[ids[i]])) < 1e-5
        _check_top([(_id(t), v) for t, v in lp.top_logprobs[i].items()], ids[i], row, n)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_completion_logprobs_and_echo_equal_transformers(served, temperature):
    hf, client, _ = served
    prompt = "def f(x): return x"
    kw = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=temperature, seed=7, logprobs=3)
    for echo in (False, True):
        r = client.completions.create(**kw, echo=echo, n=2)
        for choice in r.choices:
            _check_completion(hf, prompt, choice.logprobs, choice.text, 3, echo)
    chunks = list(client.completions.create(**kw, echo=True, stream=True))
    streamed = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for c in chunks:
        for k in streamed:
            streamed[k] += getattr(c.choices[0].logprobs, k)
    plain = client.completions.create(**kw, echo=True).choices[0]
    assert streamed == plain.logprobs.model_dump() or temperature > 0  # a seeded draw repeats, but pin greedy only
    _check_completion(hf, prompt, SimpleNamespace(**streamed), "".join(c.choices[0].text for c in chunks), 3, True)
    only_prompt = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert only_prompt.choices[0].text == prompt and len(only_prompt.choices[0].logprobs.tokens) == len(prompt)
    _check_completion(hf, prompt, only_prompt.choices[0].logprobs, prompt, 0, True)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_chat_logprobs_equal_transformers(served, temperature):
    hf, client, _ = served
    messages = [{"role": "user", "content": "hi there"}]
    prompt = list(plain_template(messages).encode("latin-1"))
    kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=temperature, seed=3, logprobs=True)
    r = client.chat.completions.create(**kw, top_logprobs=2)
    chunks = list(client.chat.completions.create(**kw, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    for content in (r.choices[0].logprobs.content, streamed):
        ids = [e.bytes[0] if e.bytes else TOK.eos_id for e in content]
        assert "".join(e.token for e in content) == TOK.decode(ids) and len(ids) > 0
        ref = _reference(hf, prompt + ids)
        for j, e in enumerate(content):
            row = ref[len(prompt) - 1 + j]
            assert e.bytes == [ids[j]] and abs(e.logprob - float(row[ids[j]])) < 1e-5
            _check_top([(t.bytes[0] if t.bytes else TOK.eos_id, t.logprob) for t in e.top_logprobs], ids[j], row, 2)
    assert r.choices[0].message.content == TOK.decode(ids) or temperature > 0
    none = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, logprobs=True)
    assert all(len(e.top_logprobs) == 1 for e in none.choices[0].logprobs.content)  # top_logprobs 0: the chosen only
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=3).choices[0].logprobs is None


def test_penalties_are_taken_and_change_greedy_tokens(served):
    """A greedy completion with penalties differs from one without (the formula is checked in
    tests/unit/test_logprobs.py), and the raw logprobs of the penalized tokens are still transformers'."""
    hf, client, _ = served
    kw = dict(model="tiny", prompt="aaaa", max_tokens=12, temperature=0, logprobs=1)
    free = client.completions.create(**kw).choices[0]
    penalized = client.completions.create(**kw, presence_penalty=1.0, frequency_penalty=2.0).choices[0]
    assert penalized.text != free.text
    _check_completion(hf, "aaaa", penalized.logprobs, penalized.text, 1, False)


@pytest.mark.parametrize(
    "path,body,words",
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
        ("/v1/completions", {"logprobs": -1}, "logprobs: Input should be greater than or equal to 0"),
        ("/v1/completions", {"echo": "yes"}, "echo: Input should be a valid boolean"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
        (
            "/v1/completions",
            {"frequency_penalty": -3},
            "frequency_penalty: Input should be greater than or equal to -2",
        ),
        ("/v1/completions", {"best_of": 2}, "unknown field 'best_of'"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "set logprobs to true to use top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than"),
        ("/v1/chat/completions", {"logprobs": 3}, "logprobs: Input should be a valid boolean"),
        ("/v1/chat/completions", {"echo": True}, "unknown field 'echo'"),
    ],
)
def test_out_of_range_values_and_unknown_fields_get_a_400(served, path, body, words):
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    conn = http.client.HTTPConnection("127.0.0.1", served[2], timeout=60)
    conn.request("POST", path, json.dumps({**base, "max_tokens": 1, **body}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    message = json.loads(r.read())["error"]["message"]
    assert r.status == 400 and words in message, (r.status, message)
