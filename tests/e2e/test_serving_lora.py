"""Many LoRA adapters served at once: a tiny Llama from transformers and two adapters made by ``peft`` itself, served
with the official ``openai`` client choosing them by model name, requests of both adapters and the base in flight
together. Each reply equals transformers + peft's greedy generation with that adapter, its log-probabilities peft's
log-softmax; ``/v1/models`` lists the adapters; an unknown model is a 404; ``trickles serve --lora`` builds the bank
and its refusals are one line each."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from helpers import cli_here, tiny_hf_llama

pytest.importorskip("fastapi", exc_type=ImportError)  # the serve extra (CI installs it: a skip there fails)
pytest.importorskip("uvicorn", exc_type=ImportError)
openai = pytest.importorskip("openai", exc_type=ImportError)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from trickles.adapters.loaded import load_adapter  # noqa: E402
from trickles.adapters.multi import AdapterBank  # noqa: E402
from trickles.data import ByteTokenizer  # noqa: E402
from trickles.infer.engine import EngineConfig  # noqa: E402
from trickles.infer.listen import BackgroundServer  # noqa: E402
from trickles.infer.server import create_app  # noqa: E402
from trickles.models import load_hf  # noqa: E402

TOK = ByteTokenizer()
ADAPTERS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "chat": dict(
        r=2, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"]
    ),
}
PROMPTS = {"sql": "select ", "chat": "hello", "tiny": "def f"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_serving")
    hf = tiny_hf_llama(root / "base", vocab_size=260)
    with torch.no_grad():  # norms that are not all ones
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(root / "base")
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        fresh = transformers.AutoModelForCausalLM.from_pretrained(root / "base", attn_implementation="sdpa")
        lora = peft.get_peft_model(fresh, peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():  # peft starts B small: make each adapter move the replies
            for n, p in lora.named_parameters():
                if "lora_B" in n:
                    p.mul_(30.0)
        lora.save_pretrained(root / name)
    return root


def _peft_reference(dirs, name: str, prompt: list[int], n: int):
    """transformers + peft's greedy tokens and their log-softmax for adapter ``name`` (None: the base alone)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs / "base", attn_implementation="sdpa")
    if name is not None:
        model = peft.PeftModel.from_pretrained(model, dirs / name)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(z[0].float(), -1)[t].item() for z, t in zip(out.logits, tokens)]
    return tokens, logprobs


def test_adapters_chosen_by_model_name_equal_transformers_with_peft(dirs):
    model = load_hf(dirs / "base").eval()
    adapters = [load_adapter(str(dirs / name), model.cfg, name) for name in ADAPTERS]
    bank = AdapterBank(model, adapters, max_loras=2)
    config = EngineConfig(max_batch=8, block_size=4, num_blocks=64, adapters=bank)
    background = BackgroundServer(create_app(model, TOK, name="tiny", engine_config=config))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{background.port}/v1", api_key="x", max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"tiny", "sql", "chat"}
        assert listed["sql"].parent == "tiny" and listed["sql"].root == str(dirs / "sql")

        def ask(name):
            return client.completions.create(
                model=name, prompt=PROMPTS[name], max_tokens=8, temperature=0, logprobs=1
            ).choices[0]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # every adapter and the base in flight at once
            replies = list(pool.map(ask, [*PROMPTS, *PROMPTS]))
        for name, choice in zip([*PROMPTS, *PROMPTS], replies):
            prompt = TOK.encode_prompt(PROMPTS[name])
            tokens, logprobs = _peft_reference(dirs, None if name == "tiny" else name, prompt, 8)
            assert choice.text == TOK.decode(tokens), name
            torch.testing.assert_close(choice.logprobs.token_logprobs, logprobs, rtol=0, atol=1e-5)
        assert len({r.text for r in replies[:3]}) == 3  # the adapters change the replies

        chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.model == "chat" and chat.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.NotFoundError, match="the model 'nope' is not served here"):
            client.completions.create(model="nope", prompt="a", max_tokens=1)
    finally:
        background.stop()


def test_serve_builds_the_bank_from_lora_flags(dirs, monkeypatch):
    from trickles.cli import serve

    seen = {}
    monkeypatch.setattr(serve, "load_model", lambda path, *a, **k: (load_hf(path).eval(), TOK, {}))
    monkeypatch.setattr(serve, "listen", lambda *a, adapters=None, **k: seen.setdefault("bank", adapters) and 0)
    r = cli_here("serve", dirs / "base", "--device", "cpu", "--lora", f"sql={dirs / 'sql'}", "--max-loras", "1")
    assert r.returncode == 0, r.stderr
    assert seen["bank"].names == ["sql"] and seen["bank"].max_loras == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lora", "sql"], "--lora 'sql': give NAME=DIR"),
        (["--lora", "base={dirs}/sql"], "--lora 'base={dirs}/sql': the name 'base' is already the served model's"),
        (
            ["--lora", "a={dirs}/sql", "--lora", "a={dirs}/chat"],
            "--lora 'a={dirs}/chat': the name 'a' is already another adapter's",
        ),
        (["--lora", "a={dirs}/nowhere"], "--lora 'a={dirs}/nowhere': {dirs}/nowhere is no directory"),
        (["--max-loras", "2"], "--max-loras applies with --lora NAME=DIR"),
        (["--lora", "a={dirs}/sql", "--batching", "static"], "--lora applies to --batching continuous only"),
        (["--lora", "a={dirs}/sql", "--int8", "weight"], "--lora cannot be combined with --int8"),
    ],
)
def test_serve_refuses_bad_lora_flags_in_one_line(dirs, args, message):
    r = cli_here("serve", dirs / "base", *[a.replace("{dirs}", str(dirs)) for a in args])
    want = message.replace("{dirs}", str(dirs))
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith(f"error: {want}"), r.stderr
    assert r.stderr.count("\n") == 1
