"""Structured output over HTTP: the official ``openai`` client asks for ``response_format`` (``json_schema`` on chat,
plain and streamed, ``json_object``, and a schema on completions through ``extra_body``) and every reply validates;
a free request served at the same time as constrained ones gets the text it gets alone; a schema the grammar library
cannot compile gets a 400 whose message is the library's, on one line, and the server goes on."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

pytest.importorskip("fastapi", exc_type=ImportError)  # the serve and grammar extras (CI installs them)
pytest.importorskip("uvicorn", exc_type=ImportError)
pytest.importorskip("xgrammar", exc_type=ImportError)
openai = pytest.importorskip("openai", exc_type=ImportError)
jsonschema = pytest.importorskip("jsonschema", exc_type=ImportError)

from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer import Sampling, decode  # noqa: E402
from trickles.infer.engine import EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.infer.server import create_app  # noqa: E402
from trickles.models import ModelConfig, build_model  # noqa: E402

TOK = ByteTokenizer()
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
COLOR = {"enum": ["red", "green", "blue"]}


@pytest.fixture(scope="module")
def server():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=260, max_seq_len=512)
    model = build_model(cfg, seed=0).eval()
    app = create_app(model, TOK, name="tiny", engine_config=EngineConfig(max_batch=16, block_size=16, num_blocks=256))
    background = BackgroundServer(app)
    yield background.port, model
    background.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="none", max_retries=0, timeout=120)


def _schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_the_openai_client_gets_json_under_a_schema_plain_and_streamed(client):
    messages = [{"role": "user", "content": "who?"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, seed=1, n=3, response_format=_schema("person", PERSON)
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, seed=2, stream=True, response_format=_schema("person", PERSON)
    )
    chunks = list(stream)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"
    loose = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=200, seed=3, response_format={"type": "json_object"}
    )
    assert loose.choices[0].finish_reason == "stop" and isinstance(json.loads(loose.choices[0].message.content), dict)
    cut = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, seed=1, response_format=_schema("person", PERSON)
    )
    assert cut.choices[0].finish_reason == "length"
    completion = client.completions.create(
        model="tiny", prompt="color: ", max_tokens=20, seed=4, extra_body={"response_format": _schema("color", COLOR)}
    )
    assert json.loads(completion.choices[0].text) in COLOR["enum"]


def test_a_free_request_beside_constrained_ones_gets_its_text_alone(server, client):
    _, model = server
    [alone] = decode(model, [TOK.encode("def ")], Sampling(max_new_tokens=24, temperature=0), eos_id=TOK.eos_id)
    texts = []

    def constrained(seed):
        r = client.completions.create(
            model="tiny",
            prompt="who: ",
            max_tokens=120,
            seed=seed,
            extra_body={"response_format": _schema("person", PERSON)},
        )
        texts.append(r.choices[0].text)

    threads = [threading.Thread(target=constrained, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    free = client.completions.create(model="tiny", prompt="def ", max_tokens=24, temperature=0)
    for t in threads:
        t.join()
    assert free.choices[0].text == TOK.decode(alone.tokens)
    assert len(texts) == 4


def test_an_invalid_schema_gets_a_400_with_the_library_message_on_one_line(server, client):
    port = server[0]
    body = {"prompt": "x", "max_tokens": 4, "response_format": _schema("bad", {"type": "colour"})}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    message = json.loads(r.read())["error"]["message"]
    assert r.status == 400 and "\n" not in message
    assert (
        message.startswith("response_format: the JSON schema cannot be used: ")
        and 'Unsupported type "colour"' in message
    )
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema"}
        )
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")
