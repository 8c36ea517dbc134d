"""Chat data (``data.format = "chat"``): the trained positions of three locally built tokenizers' templates -- one
with ``{% generation %}`` blocks (exactly transformers' assistant mask), one without and one in the Llama-3 style
(the documented rendering rule) -- prompt/completion records as TRL tokenizes them, conversations packed whole with
their document ids and ``-100`` targets, a packed batch's loss equal to the conversations' own, the overlong counts
(the run's data line, and its metrics records' ``overlong_cut`` / ``overlong_dropped``), a checkpoint's copy of
the tokenizer rendering as its source, and the one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import tiny_config

from trickles.data.chat import START, TRAINED, chat_template
from trickles.data.corpus import Corpus, check_boundaries, load_corpus
from trickles.data.loader import ShardedBatches
from trickles.data.mixture import Mixture, overlong_counts
from trickles.data.tokenizers import build_tokenizer
from trickles.errors import DataError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

NL = "{{ '\\n' }}"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
REWRITES = (  # earlier assistant turns shortened: not rendered incrementally
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n...<|im_end|>\\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]
CHATS = [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the sky's colour?"},
        {"role": "assistant", "content": "It is blue."},
        {"role": "user", "content": "And the grass?"},
        {"role": "assistant", "content": "Green, mostly."},
    ],
    [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there!"}],
    [{"role": "user", "content": "Count to three"}, {"role": "assistant", "content": "One, two, three."}],
]


def make_tokenizer(root, template: str | None, bos: str | None = None, eos: str = "<|endoftext|>"):
    """A byte-level BPE trained on a few lines, with the chat specials, saved by transformers with ``template``."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [m["content"] for chat in CHATS for m in chat] + ["user assistant system the a colour blue"] * 4
    tk.train_from_iterator(text, trainer=trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, bos_token=bos)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(root)
    return tok


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tokenizers")
    out = {}
    for name, template, bos, eos in (
        ("generation", CHATML, None, "<|im_end|>"),
        ("plain", PLAIN, None, "<|endoftext|>"),
        ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
        ("none", None, None, "<|endoftext|>"),
        ("rewrites", REWRITES, None, "<|endoftext|>"),
    ):
        out[name] = (str(root / name), make_tokenizer(root / name, template, bos, eos))
    return out


def _template(path, **keys):
    cfg = tiny_config(path, f"data.tokenizer={path}", "data.format=chat", **keys).data
    return chat_template(cfg, build_tokenizer(cfg))


def _runs(tok, ids, mask):
    """The trained tokens' text, one string per run of consecutive trained tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(int(i))
        elif cur:
            runs, cur = runs + [tok.decode(cur)], []
    return runs + ([tok.decode(cur)] if cur else [])


def test_generation_blocks_train_exactly_transformers_assistant_mask(toks):
    path, tok = toks["generation"]
    template = _template(path)
    assert template.has_generation
    for chat in CHATS:
        ids, mask = template.conversation(chat)
        ref = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(ref["input_ids"])
        assert mask.astype(int).tolist() == list(ref["assistant_masks"])
        assert _runs(tok, ids, mask) == [m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]


@pytest.mark.parametrize(
    "name, turn_end", [("plain", lambda c: c + "<|im_end|>\n"), ("llama3", lambda c: c.strip() + "<|eot_id|>")]
)
def test_without_generation_blocks_the_assistant_content_and_its_turn_end_train(toks, name, turn_end):
    """The documented rule: from the end of the prefix rendered with the generation prompt (the role header) to the
    end of the message's rendering -- its content and the end of its turn, no header."""
    path, tok = toks[name]
    template = _template(path)
    assert not template.has_generation
    for chat in CHATS:
        ids, mask = template.conversation(chat)
        assert ids.tolist() == tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert _runs(tok, ids, mask) == [turn_end(m["content"]) for m in chat if m["role"] == "assistant"]


def test_prompt_completion_as_trl_tokenizes_it(toks):
    path, tok = toks["llama3"]
    template = _template(path)
    ids, mask = template.prompt_completion("The sky is", " blue.")
    assert ids.tolist() == tok("The sky is blue.<|eot_id|>")["input_ids"]
    assert mask.sum() == len(ids) - len(tok("The sky is")["input_ids"]) and not mask[: -mask.sum()].any()
    prompt, completion = CHATS[1][:1], CHATS[1][1:]
    ids, mask = template.prompt_completion(prompt, completion)
    whole = tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    head = tok.apply_chat_template(prompt, tokenize=True, return_dict=True)["input_ids"]
    assert ids.tolist() == whole and mask.tolist() == [False] * len(head) + [True] * (len(whole) - len(head))


def test_a_saved_copy_renders_the_template_as_its_source_does(toks, tmp_path):
    """A checkpoint's copy of the tokenizer (``HFTokenizer.save``, read back as ``trickles eval``, ``generate`` and
    ``serve`` read it) renders a Llama-3 style template -- which begins with ``bos_token`` -- exactly as the source
    directory does: the training data's ids and trained positions, the chat prompt, and transformers' own rendering;
    and a copy of the copy as well."""
    import dataclasses

    from trickles.data.tokenizers import load_tokenizer
    from trickles.infer.chat import render_chat

    path, tok = toks["llama3"]
    cfg = tiny_config(tmp_path, f"data.tokenizer={path}", "data.format=chat").data
    source = build_tokenizer(cfg)
    want = chat_template(cfg, source)
    source.save(tmp_path / "ckpt")
    load_tokenizer(tmp_path / "ckpt").save(tmp_path / "again")
    for saved in (str(tmp_path / "ckpt"), str(tmp_path / "again")):
        copy = load_tokenizer(saved)
        got = chat_template(dataclasses.replace(cfg, tokenizer=saved), copy)
        theirs = transformers.AutoTokenizer.from_pretrained(saved)
        for chat in CHATS:
            text = want.render(chat)[0]
            assert text.startswith("<|begin_of_text|>") and got.render(chat)[0] == text
            assert [a.tolist() for a in got.conversation(chat)] == [a.tolist() for a in want.conversation(chat)]
            prompt = tok.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True)
            assert render_chat(chat[:-1], copy) == prompt  # generate / serve of the checkpoint
            assert theirs.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(chat, tokenize=False)


def _write(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_conversations_pack_whole_with_documents_and_masked_targets(toks, tmp_path):
    path, tok = toks["llama3"]  # (its eos, <|eot_id|>, ends every turn: documents come from the flags, not eos)
    long = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "ok " * 80}]
    _write(
        tmp_path / "c.jsonl",
        [{"messages": c} for c in CHATS * 4] + [{"messages": long}] + [{"prompt": "a", "completion": "b"}],
    )
    counts, corpora = {}, {}
    for overlong in ("truncate", "drop"):
        cfg = tiny_config(
            tmp_path,
            f"data.source={tmp_path}/c.jsonl",
            f"data.tokenizer={path}",
            "data.format=chat",
            "data.seq_len=96",
            "data.val_fraction=0.2",
            f"data.overlong={overlong}",
        ).data
        assert cfg.document_mask  # implied by chat data
        corpus = load_corpus(cfg, build_tokenizer(cfg))
        counts[overlong], corpora[overlong] = corpus.chat, corpus
        assert "chat: " in corpus.describe() and f"data.overlong={overlong}" in corpus.describe()
    assert counts["truncate"]["truncated"] == 1 and counts["truncate"]["dropped"] == 0
    assert counts["drop"]["dropped"] == 1 and counts["drop"]["conversations"] == 13
    assert counts["truncate"]["conversations"] == 14 and counts["truncate"]["untrained"] == 0
    # what every metrics record says: one source's counts, a mixture's summed over its chat sources
    assert overlong_counts(corpora["truncate"]) == {"overlong_cut": 1, "overlong_dropped": 0}
    assert overlong_counts(corpora["drop"]) == {"overlong_cut": 0, "overlong_dropped": 1}
    mixed = Mixture(
        ["a", "b", "c"], [0.4, 0.4, 0.2], [corpora["truncate"], corpora["drop"], Corpus(corpus.train, corpus.val)]
    )
    assert overlong_counts(mixed) == {"overlong_cut": 1, "overlong_dropped": 1}
    assert overlong_counts(Corpus(corpus.train, corpus.val)) == {}  # no chat data: no counts
    template = _template(path)
    expected = [template.conversation(c) for c in CHATS * 4]
    flags = np.asarray(corpus.train_flags)
    assert len(corpus.train) % 96 == 1 and len(corpus.val) % 96 == 1 and len(corpus.val) > 1
    batches = ShardedBatches(corpus.train, 96, 0, flags=corpus.train_flags)
    seen = []
    for w in range(batches.n_windows):
        x, y, _, docs = batches._gather(np.array([w]), 1)[0]
        window = np.asarray(corpus.train[w * 96 : w * 96 + 97])
        f = flags[w * 96 : w * 96 + 97]
        assert (
            y[0]
            == torch.where(torch.from_numpy(f[1:] & TRAINED) > 0, torch.from_numpy(window[1:].astype(np.int64)), -100)
        ).all()
        starts = np.flatnonzero(f[:-1] & START)
        assert starts[0] == 0 and docs[0].tolist() == np.cumsum((f[:-1] & START) > 0).tolist()
        bounds = list(starts) + [96]
        for a, b in zip(bounds, bounds[1:]):
            seen.append((window[a:b].tolist(), (f[a:b] & TRAINED).astype(bool).tolist()))
    for ids, mask in expected[:10]:  # every conversation is one document, whole, its first token untrained
        assert (ids.tolist(), [False] + mask[1:].tolist()) in seen


def test_a_packed_batch_has_the_loss_of_its_conversations_alone(toks, tmp_path):
    """The mean loss over the packed batch's trained targets equals the conversations' own losses run one by one
    (each alone from position 0, the targets its mask trains), summed and divided by the trained tokens."""
    from trickles.models.config import resolve_model
    from trickles.models.transformer import Transformer

    path, _ = toks["plain"]
    _write(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    cfg = tiny_config(
        tmp_path,
        f"data.source={tmp_path}/c.jsonl",
        f"data.tokenizer={path}",
        "data.format=chat",
        "data.seq_len=192",
        "data.val_fraction=0",
    ).data
    tok = build_tokenizer(cfg)
    corpus = load_corpus(cfg, tok)
    assert corpus.chat["sequences"] == 1
    torch.manual_seed(0)
    model = Transformer(resolve_model(tiny_config(tmp_path).model, tok.vocab_size, 192))
    model.init_weights(0)
    x, y, _, docs = ShardedBatches(corpus.train, 192, 0, flags=corpus.train_flags).micro_batches(0, 1, 1)[0]
    with torch.no_grad():
        packed = float(model(x, target=y, documents=docs))
        total, count = 0.0, 0
        for chat in CHATS:
            ids, mask = _template(path).conversation(chat)
            ids = torch.from_numpy(ids)[None]
            target = ids[:, 1:].masked_fill(~torch.from_numpy(mask[1:])[None], -100)
            n = int((target != -100).sum())
            total += float(model(ids[:, :-1], target=target)) * n
            count += n
    assert int((y != -100).sum()) == count
    assert abs(packed - total / count) < 1e-5


def test_bad_chat_input_is_refused_in_one_line(toks, tmp_path):
    path, _ = toks["plain"]
    cases = {
        "no messages": ([{"text": "hi"}], path, "no 'messages' list"),
        "unknown role": ([{"messages": [{"role": "robot", "content": "x"}]}], path, "unknown role 'robot'"),
        "no template": ([{"messages": CHATS[1]}], toks["none"][0], "has no chat template"),
        "byte tokenizer": ([{"messages": CHATS[1]}], "byte", "a Hugging Face tokenizer's chat template"),
        "rewrites turns": ([{"messages": CHATS[0]}], toks["rewrites"][0], "1: the chat template does not render"),
    }
    for name, (records, tokenizer, words) in cases.items():
        _write(tmp_path / f"{name}.jsonl", records)
        cfg = tiny_config(
            tmp_path, f"data.source={tmp_path}/{name}.jsonl", f"data.tokenizer={tokenizer}", "data.format=chat"
        ).data
        with pytest.raises(DataError) as e:
            check_boundaries(cfg)
        assert words in str(e.value) and "\n" not in str(e.value), (name, str(e.value))


def test_weighted_micro_batches_give_the_mean_over_the_global_batchs_trained_targets(toks, tmp_path):
    """Cut into micro-batches (gradient accumulation), the weighted per-micro-batch losses average to the loss of the
    whole batch at once -- the mean over its trained targets -- and a micro-batch of no trained target has loss 0."""
    from trickles.data.loader import weigh
    from trickles.kernels.cross_entropy import cross_entropy
    from trickles.models.config import resolve_model
    from trickles.models.transformer import Transformer

    path, _ = toks["generation"]
    _write(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS * 3])
    keys = ["data.format=chat", "data.seq_len=96", "data.val_fraction=0", f"data.tokenizer={path}"]
    cfg = tiny_config(tmp_path, f"data.source={tmp_path}/c.jsonl", *keys).data
    tok = build_tokenizer(cfg)
    corpus = load_corpus(cfg, tok)
    data = ShardedBatches(corpus.train, 96, 3, flags=corpus.train_flags)
    assert data.n_windows >= 4
    torch.manual_seed(0)
    model = Transformer(resolve_model(tiny_config(tmp_path).model, tok.vocab_size, 96))
    model.init_weights(0)
    whole = data.micro_batches(0, 4, 4)[0]
    micro = weigh(data.micro_batches(0, 4, 1), data.trained_targets(0, 4), replicas=1)
    assert data.trained_targets(0, 4) == int((whole[1] != -100).sum())
    assert len({round(b[4], 6) for b in micro}) > 1  # rows of different trained counts
    with torch.no_grad():
        at_once = float(model(whole[0], target=whole[1], documents=whole[3]))
        accumulated = sum(float(model(x, target=y, documents=d)) * w for x, y, _, d, w in micro) / len(micro)
    assert abs(at_once - accumulated) < 1e-5
    assert float(cross_entropy(torch.randn(3, 5), torch.full((3,), -100))) == 0.0
