"""``trickles eval``: the loss over a whole source equals transformers' on the same windows, whatever the file format,
the layout or the mixture around a source; chat data's equals transformers' assistant-only loss on each conversation
alone, and counts the conversations left out for their length; a LoRA run is evaluated with its adapters; ``--json``
prints one line of the documented shape; bad input is refused in one line.

One tiny ``LlamaForCausalLM`` built by transformers (hidden 32, 2 layers, 4 heads, 2 key/value heads, vocabulary 320
so the byte tokenizer fits), saved without a tokenizer, and two small JSONL sources (lines of ``argparse`` and of
``typing``) serve every test."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import typing

import pytest
import torch
import torch.nn.functional as F
from helpers import cli_here, tiny_hf_llama

from trickles.testing import run_command

transformers = pytest.importorskip("transformers")

SEQ = 32
TOL = 1e-5  # relative; the gaps seen: under 2e-7 (fp32 sums in another order)


def _lines(module, n: int) -> list[str]:
    return [line for line in inspect.getsource(module).splitlines() if line.strip()][:n]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``(hf_dir, {name: (jsonl path, texts)}, cache_dir)``, with ``a``'s texts also as parquet (``a.parquet``)."""
    root = tmp_path_factory.mktemp("eval")
    tiny_hf_llama(root / "hf")
    sources = {}
    for name, module, n in (("a", argparse, 120), ("b", typing, 60)):
        texts = _lines(module, n)
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        sources[name] = (str(path), texts)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": sources["a"][1]}), root / "a.parquet")
    return str(root / "hf"), sources, str(root / "cache")


def _windows(texts: list[str]) -> torch.Tensor:
    """The byte tokenizer's windows of ``SEQ + 1`` tokens over the texts, each followed by its eos (id 256)."""
    ids = torch.tensor([i for t in texts for i in [*t.encode(), 256]])
    n = (len(ids) - 1) // SEQ
    return torch.stack([ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)])


def _transformers_loss(model, texts: list[str], positions: int | None = None) -> float:
    """transformers' mean cross-entropy over every window's predictions (the first ``positions`` of them)."""
    w = _windows(texts)
    with torch.no_grad():
        logits = model(w[:, :-1]).logits.float()
    losses = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="none")
    return losses[:positions].mean().item()


def _eval(model: str, cache: str, *args: str, nproc: int = 1) -> dict:
    """``trickles eval MODEL ARGS --json``'s one line (in this process, or ``--nproc`` ranks in a new one)."""
    common = ["eval", model, "--json", "--set", "data.tokenizer=byte", "--set", f"data.seq_len={SEQ}"]
    common += ["--set", "train.global_batch=8", "--set", f"data.cache_dir={cache}", *args]
    if nproc > 1:
        r = run_command([sys.executable, "-m", "trickles", *common, "--nproc", str(nproc)], text=True, timeout=300)
    else:
        r = cli_here(*common)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    return json.loads(lines[0])


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * abs(b)


@pytest.fixture(scope="module")
def hf_model(files):
    return transformers.LlamaForCausalLM.from_pretrained(files[0]).eval()


@pytest.fixture(scope="module")
def one(files):
    """Source ``a`` evaluated in one process (the reference of the layouts and the mixture)."""
    hf, sources, cache = files
    return _eval(hf, cache, "--data", sources["a"][0])


def test_eval_equals_transformers_on_every_window_and_parquet_equals_jsonl(files, hf_model, one):
    hf, sources, cache = files
    path, texts = sources["a"]
    got = one
    n = len(_windows(texts))
    assert set(got) == {"loss", "tokens", "perplexity", "windows", "seq_len"}
    assert got["windows"] == n and got["tokens"] == n * SEQ and got["seq_len"] == SEQ
    want = _transformers_loss(hf_model, texts)
    assert _close(got["loss"], want), (got["loss"], want)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)
    # the same texts as parquet: the same windows, the same loss
    parquet = _eval(hf, cache, "--data", path.replace(".jsonl", ".parquet"))
    assert parquet["tokens"] == got["tokens"] and _close(parquet["loss"], got["loss"])
    # --max-tokens: the first N positions, the last window cut
    capped = _eval(hf, cache, "--data", path, "--max-tokens", "100")
    assert capped["tokens"] == 100 and capped["windows"] == 4
    assert _close(capped["loss"], _transformers_loss(hf_model, texts, 100))


LAYOUTS = {
    "dp2": ("--set", "parallel.dp=2"),
    "tp2": ("--set", "parallel.tp=2"),
    "pp2": ("--set", "parallel.pp=2"),
    "cp2": ("--set", "parallel.cp=2"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_equal_one_process(files, one, layout):
    hf, sources, cache = files
    path = sources["a"][0]
    two = _eval(hf, cache, "--data", path, *LAYOUTS[layout], nproc=2)
    assert two["tokens"] == one["tokens"] and two["windows"] == one["windows"]
    assert _close(two["loss"], one["loss"]), (two["loss"], one["loss"])


def test_mixture_reports_each_source_as_if_alone(files, one):
    hf, sources, cache = files
    (a, _), (b, _) = sources["a"], sources["b"]
    mixed = _eval(hf, cache, "--set", f"data.sources={a}:1,{b}:3")
    assert set(mixed) == {"loss", "tokens", "perplexity", "windows", "seq_len", "sources", "weighted_loss"}
    alone = {"a": one, "b": _eval(hf, cache, "--data", b)}
    assert set(mixed["sources"]) == {"a", "b"}
    for name, one in alone.items():
        got = mixed["sources"][name]
        assert got["tokens"] == one["tokens"] and got["windows"] == one["windows"]
        assert _close(got["loss"], one["loss"]) and set(got) == {"loss", "tokens", "perplexity", "windows"}
    la, lb, ta, tb = alone["a"]["loss"], alone["b"]["loss"], alone["a"]["tokens"], alone["b"]["tokens"]
    assert mixed["tokens"] == ta + tb
    assert _close(mixed["loss"], (la * ta + lb * tb) / (ta + tb))  # every token weighs the same
    assert _close(mixed["weighted_loss"], (la + 3 * lb) / 4)  # the sources' shares


def test_a_lora_run_is_evaluated_with_its_adapters_on_its_own_data(files, hf_model, tmp_path):
    from trickles.train.load import load_for_inference

    hf, sources, cache = files
    path, texts = sources["a"]
    run = tmp_path / "run"
    r = cli_here(
        *("train", "--quiet", "--init-from", hf, "--set", "data.tokenizer=byte", "--set", f"data.seq_len={SEQ}"),
        *("--set", f"data.source={path}", "--set", f"data.cache_dir={cache}", "--set", "train.steps=3"),
        *("--set", "train.global_batch=4", "--set", "train.lr=1e-2", "--set", "train.warmup_steps=0"),
        *("--set", "train.eval_every=0", "--set", "train.sample_tokens=0", "--set", "train.plot=false"),
        *("--set", f"train.out_dir={run}", "--set", "train.lora_rank=4", "--set", "model.fused_proj=false"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli_here("eval", run, "--json")  # no data given: the run's own (its source, seq_len, cache)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    merged, _, _ = load_for_inference(str(run))  # the adapters folded into their weights
    w = _windows(texts)
    with torch.no_grad():
        want = merged(w[:, :-1], target=w[:, 1:]).item()
    assert got["tokens"] == len(w) * SEQ and _close(got["loss"], want), (got["loss"], want)
    assert not _close(got["loss"], _transformers_loss(hf_model, texts))  # the adapters moved it
    tp2 = _eval(str(run), cache, "--set", "parallel.tp=2", nproc=2)  # the adapters split like their weights
    assert _close(tp2["loss"], got["loss"]), (tp2["loss"], got["loss"])


def test_bad_input_is_one_line_before_anything_starts(files, tmp_path):
    hf, sources, cache = files
    cases = {
        "does not exist; give a checkpoint": ("eval", tmp_path / "nothing", "--data", sources["a"][0]),
        "carries no data": ("eval", hf, "--set", "data.tokenizer=byte"),
        "is not a file": ("eval", hf, "--data", tmp_path / "missing.jsonl", "--nproc", "2"),
        "at least 1": ("eval", hf, "--data", sources["a"][0], "--max-tokens", "0"),
        "no complete checkpoint": ("eval", tmp_path, "--data", sources["a"][0]),
    }
    for words, args in cases.items():
        r = cli_here(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, (words, r.stderr)


GENERATION = (  # a Llama-3 style template whose assistant turns are generation blocks (transformers' assistant mask)
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
)
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = "the sky is blue grass green sea wide sun bright moon pale tree tall stone grey".split()


def _chats(n: int) -> list[list[dict]]:
    """``n`` short conversations of one or two exchanges, some with a system message."""
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for j in range(1 + i % 2):
            q = " ".join(WORDS[(i + j + k) % len(WORDS)] for k in range(2))
            a = " ".join(WORDS[(2 * i + j + k) % len(WORDS)] for k in range(1 + i % 4))
            turns += [{"role": "user", "content": f"About {q}?"}, {"role": "assistant", "content": a}]
        out.append(turns)
    return out


def _assistant_loss(logits_of, tok, chats) -> tuple[float, int]:
    """``(loss, tokens)``: the mean cross-entropy of ``logits_of(ids [1, T])`` over the targets transformers' assistant
    mask marks, each conversation run alone."""
    total, count = 0.0, 0
    for messages in chats:
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = torch.tensor(enc["input_ids"]), torch.tensor(enc["assistant_masks"]).bool()
        assert len(ids) <= 96 and 0 < int(mask.sum()) < len(ids)
        with torch.no_grad():
            logits = logits_of(ids[None, :-1])[0].float()
        losses = F.cross_entropy(logits, ids[1:], reduction="none")[mask[1:]]
        total, count = total + float(losses.double().sum()), count + len(losses)
    return total / count, count


def test_chat_data_counts_the_assistant_tokens_of_each_conversation_alone(tmp_path):
    """Conversations packed into sequences with their document masks: the eval loss is transformers' loss on the
    assistant-masked targets of each conversation run alone, over all of them."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator([" ".join(WORDS)] * 8 + ["About Be brief. user assistant system"] * 4, bpe)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=SPECIALS[0], eos_token="<|eot_id|>")
    tok.chat_template = GENERATION
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    chats = _chats(24)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))

    args = ("--set", f"data.source={tmp_path}/chats.jsonl", "--set", "data.format=chat", "--set", "data.seq_len=96")
    r = cli_here("eval", tmp_path / "hf", *args, "--set", f"data.cache_dir={tmp_path}/cache", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got, (loss, count) = json.loads(r.stdout), _assistant_loss(lambda ids: model(ids).logits, tok, chats)
    assert got["tokens"] == count and _close(got["loss"], loss), (got, loss)
    assert (got["overlong_cut"], got["overlong_dropped"]) == (0, 0)
    # shorter sequences, the conversations that no longer fit left out: counted, and the loss is the others'
    fits = [c for c in chats if len(tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) <= 40]
    assert 0 < len(fits) < len(chats)
    short = ("--set", "data.seq_len=40", "--set", "data.overlong=drop")
    r = cli_here("eval", tmp_path / "hf", *args, *short, "--set", f"data.cache_dir={tmp_path}/cache", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got, (loss, count) = json.loads(r.stdout), _assistant_loss(lambda ids: model(ids).logits, tok, fits)
    assert got["tokens"] == count and _close(got["loss"], loss), (got, loss)
    assert (got["overlong_cut"], got["overlong_dropped"]) == (0, len(chats) - len(fits))

    # a chat run's checkpoint, given no data: its run's conversations, read with its run's tokenizer and template
    from trickles.train.load import load_for_inference

    run = tmp_path / "run"
    keys = ["train.steps=2", "train.global_batch=4", "train.lr=1e-2", "train.warmup_steps=0", "train.eval_every=0"]
    keys += ["train.sample_tokens=0", "train.plot=false", f"train.out_dir={run}", f"data.cache_dir={tmp_path}/cache"]
    r = cli_here("train", "--quiet", "--init-from", tmp_path / "hf", *args, *(a for k in keys for a in ("--set", k)))
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli_here("eval", run, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    trained, _, _ = load_for_inference(str(run))
    got, (loss, count) = json.loads(r.stdout), _assistant_loss(trained, tok, chats)
    assert got["tokens"] == count and _close(got["loss"], loss), (got, loss)
