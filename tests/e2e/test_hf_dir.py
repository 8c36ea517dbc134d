"""The command line straight from a Hugging Face model directory: ``generate`` and ``serve`` read one (its tokenizer's
special tokens and chat template as transformers applies them), ``train.init_from`` starts a run from its weights
under one process and tensor parallelism, ``model.from_hf`` takes its shape for ``memory``, and bad directories are
refused in one line.

One tiny ``LlamaForCausalLM`` built by transformers (hidden 64, 2 layers, 4 heads, 2 key/value heads) with a byte-level
BPE that adds a BOS to every prompt and carries a chat template, saved with ``save_pretrained``, serves every test."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import sys

import pytest
import torch
from helpers import cli_here

from trickles.testing import run_command

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "def main():"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The directory, with the transformers model and tokenizer that wrote it."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    root = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    import inspect

    tk.train_from_iterator(inspect.getsource(json).splitlines(), trainer=trainer)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")
    tok.chat_template = TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms that are not all ones, so a wrongly mapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root)
    tok.save_pretrained(root)
    sharded = root.with_name("tiny-llama-sharded")  # the same model in shards with an index
    model.save_pretrained(sharded, max_shard_size="150KB")
    tok.save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    return str(root), model, tok


def _greedy(model, tok, text: str, n: int) -> str:
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0, 0].item() == tok.bos_token_id  # the tokenizer's own rule adds a BOS
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=1)
    return text + tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_generate_from_the_directory_prints_transformers_greedy_text(hf_dir):
    path, model, tok = hf_dir
    r = cli_here(
        "generate", path, "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == _greedy(model, tok, PROMPT, 12) + "\n"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("nproc, fused", [(1, False), (2, False), (2, True)])
def test_train_init_from_the_directory_exports_the_same_model(hf_dir, tmp_path, nproc, fused):
    """Two steps at a learning rate of 1e-9 from the directory's weights (one process, and tensor parallel over two,
    projections separate and fused), exported to Hugging Face: transformers loads the same class with the
    directory's logits. The fused case reads the sharded copy."""
    path, model, tok = hf_dir
    path = path + "-sharded" if fused else path
    run = tmp_path / "run"
    args = [
        "train",
        "--quiet",
        "--init-from",
        path,
        *("--set", "data.seq_len=32", "--set", "data.max_bytes=20000", "--set", f"data.cache_dir={tmp_path}/cache"),
        *("--set", "train.steps=2", "--set", "train.global_batch=2", "--set", "train.lr=1e-9"),
        *("--set", "train.warmup_steps=0", "--set", "train.eval_every=0", "--set", "train.sample_tokens=0"),
        *("--set", "train.plot=false", "--set", f"train.out_dir={run}"),
    ]
    if nproc > 1:
        args += ["--nproc", "2", "--set", "parallel.tp=2"]
    args += ["--set", f"model.fused_proj={str(fused).lower()}"]
    r = run_command([sys.executable, "-m", "trickles", *args], text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((next((run / "checkpoints").glob("step_*")) / "trainer.json").read_text())
    assert meta["step"] == 2 and meta["config"]["data"]["tokenizer"] == path  # the directory's tokenizer by default
    out = tmp_path / "hf"
    r = cli_here("checkpoint", "export", run, out, "--format", "hf")
    assert r.returncode == 0, r.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is transformers.LlamaForCausalLM
    # the directory's own tokenizer files came along: the same ids and the same chat template
    assert "tokenizer" not in r.stdout  # no note of missing tokenizer files
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    again = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": PROMPT}]
    assert again(PROMPT).input_ids == tok(PROMPT).input_ids
    assert again.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(messages, tokenize=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    want, got = _logits(model, ids), _logits(back, ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_serve_answers_a_chat_with_the_directory_template(hf_dir, monkeypatch):
    pytest.importorskip("fastapi", exc_type=ImportError)
    pytest.importorskip("uvicorn", exc_type=ImportError)
    import trickles.infer.listen as listen
    from trickles.infer.listen import BackgroundServer
    from trickles.infer.server import create_app

    path, model, tok = hf_dir
    messages = [{"role": "user", "content": "hello"}]
    seen = {}

    def serve(model_, tokenizer, host, port, name, max_batch, on_ready, **options):  # the command's server, in a thread
        app = create_app(model_, tokenizer, name=name, **options)
        background = BackgroundServer(app)
        c = http.client.HTTPConnection("127.0.0.1", background.port, timeout=60)
        body = {"model": name, "messages": messages, "max_tokens": 6, "temperature": 0}
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        seen["reply"] = json.loads(c.getresponse().read())
        background.stop()

    monkeypatch.setattr(listen, "serve", serve)
    r = cli_here("serve", path, "--device", "cpu", "--port", "0", "--max-batch", "2")
    assert r.returncode == 0, r.stderr
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    assert text.startswith("<s><|user|>hello</s>") and ids[0].tolist().count(0) == 1  # the template's one BOS
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=1)
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    reply = seen["reply"]
    assert reply["choices"][0]["message"]["content"] == want, reply
    assert reply["usage"]["prompt_tokens"] == ids.shape[1]


def test_memory_takes_the_directory_shape(hf_dir):
    path, model, _ = hf_dir
    r = cli_here(
        "memory", "--set", f"model.from_hf={path}", "--set", "data.seq_len=32", "--set", "train.global_batch=2"
    )
    assert r.returncode == 0, r.stderr
    n = sum(p.numel() for p in model.parameters())  # fp32 parameters, in KiB
    assert re.search(rf"^parameters +{n * 4 / 1024:.2f} KiB$", r.stdout, re.M), r.stdout


def test_bad_directories_are_refused_in_one_line(hf_dir, tmp_path):
    path = hf_dir[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    shutil.copytree(path, other)
    raw = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "model_type": "stablelm"}))
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "tokenizer.json").write_text("{not json")
    cases = [
        (("generate", empty, "--device", "cpu"), "nor a Hugging Face model directory: it has no config.json"),
        (("train", "--init-from", empty), "no complete checkpoint found"),
        (("memory", "--set", f"model.from_hf={empty}"), "config.json does not exist"),
        (("generate", other, "--device", "cpu"), "stablelm"),
        (("train", "--init-from", other), "stablelm"),
        (("memory", "--set", f"model.from_hf={other}"), "stablelm"),
        (("generate", broken, "--device", "cpu"), "cannot read"),
        (("train", "--init-from", broken), "cannot read"),
        (("memory", "--set", f"model.from_hf={path}", "--set", "model.n_layers=3"), "model.n_layers = 3 contradicts"),
    ]
    for args, words in cases:
        r = cli_here(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and words in lines[0], (args, r.stderr)
