"""Tokenizers, sources, the tokenized-corpus cache and the deterministic sharded loader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from trickles.data import (
    ByteTokenizer,
    DataConfig,
    ShardedBatches,
    Tokenizer,
    build_tokenizer,
    check_source,
    iter_documents,
    load_corpus,
    load_tokenizer,
)
from trickles.data.corpus import split_point
from trickles.data.sources import STDLIB_EXCLUDE, stdlib_files
from trickles.errors import DataError

TEXT = "Grüße aus Köln — 日本語のテキスト 🙂\n"


def _cfg(tmp_path, **kw) -> DataConfig:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataConfig(**kw)


def _write_docs(tmp_path, docs: list[str], name: str = "doc") -> None:
    for i, d in enumerate(docs):
        (tmp_path / f"{name}{i:02d}.txt").write_text(d, encoding="utf-8")


# ---- tokenizers ------------------------------------------------------------------------------


def test_byte_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert tok.vocab_size == 257 and tok.eos_id == 256 and max(ids) < 256
    assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
    assert tok.decode(ids + [256, 300]) == TEXT  # ids >= 256 are ignored
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 is replaced
    (arr,) = tok.encode_documents([TEXT])
    assert arr.tolist() == ids + [256]


def _bpe(tmp_path, vocab: int = 320):
    (tmp_path / "corpus.txt").write_text((TEXT + "def hello(world):\n    return world + 1\n") * 40, encoding="utf-8")
    cfg = _cfg(tmp_path, source=str(tmp_path / "corpus.txt"), tokenizer="bpe", bpe_vocab_size=vocab)
    return cfg, build_tokenizer(cfg)


def test_bpe_trains_round_trips_and_is_cached(tmp_path):
    cfg, tok = _bpe(tmp_path)
    assert tok.name == "bpe-320" and tok.vocab_size <= 320
    assert tok.decode([tok.eos_id]) == "" and tok.eos_id == tok.tk.token_to_id("<|endoftext|>")
    for text in (TEXT, "def hello(world):\n    return 2\n", "unseen ✓ words"):
        ids = tok.encode(text)
        assert max(ids) < tok.vocab_size and tok.decode(ids) == text
    assert len(tok.encode("def hello(world):")) < len("def hello(world):")  # merges were learned
    assert os.listdir(tmp_path / "cache" / "tokenizers")  # cached ...

    def boom():
        raise AssertionError("the cached tokenizer must not be trained again")

    again = build_tokenizer(cfg, documents=boom)  # ... and found again
    assert again.identity() == tok.identity() and again.encode(TEXT) == tok.encode(TEXT)


def _hf_dir(tmp_path, config_file: str | None, eos_value):
    """A tiny Hugging Face tokenizer directory built with the tokenizers library."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = HFTok(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([TEXT * 10, "hello world " * 20], trainer=trainer)
    d = tmp_path / "hf"
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    if config_file:
        (d / config_file).write_text(json.dumps({"eos_token": eos_value}))
    return d, tk


@pytest.mark.parametrize(
    "config_file,eos_value,expected",
    [
        ("tokenizer_config.json", "</s>", "</s>"),
        ("special_tokens_map.json", {"content": "<s>", "special": True}, "<s>"),
        (None, None, "</s>"),  # no config: the first common name
    ],
)
def test_hf_directory_finds_eos(tmp_path, config_file, eos_value, expected):
    d, tk = _hf_dir(tmp_path, config_file, eos_value)
    tok = build_tokenizer(_cfg(tmp_path, tokenizer=str(d)))
    assert tok.eos_id == tk.token_to_id(expected)
    assert tok.decode(tok.encode(TEXT)) == TEXT and tok.vocab_size == tk.get_vocab_size(with_added_tokens=True)


def test_tokenizer_path_without_tokenizer_json(tmp_path):
    with pytest.raises(DataError, match="empty_dir"):
        build_tokenizer(_cfg(tmp_path, tokenizer=str(tmp_path / "empty_dir")))
    with pytest.raises(DataError, match="tokenizer.json"):
        check_source(_cfg(tmp_path, tokenizer=str(tmp_path)))


@pytest.mark.parametrize("kind", ["byte", "bpe", "hf"])
def test_save_and_load_tokenizer(tmp_path, kind):
    if kind == "byte":
        tok: Tokenizer = ByteTokenizer()
    elif kind == "bpe":
        tok = _bpe(tmp_path, vocab=300)[1]
    else:
        tok = build_tokenizer(_cfg(tmp_path, tokenizer=str(_hf_dir(tmp_path, "tokenizer_config.json", "</s>")[0])))
    tok.save(tmp_path / "saved")
    back = load_tokenizer(tmp_path / "saved")
    assert type(back) is type(tok) and back.name == tok.name
    assert (back.vocab_size, back.eos_id, back.identity()) == (tok.vocab_size, tok.eos_id, tok.identity())
    assert back.encode(TEXT) == tok.encode(TEXT) and back.decode(tok.encode(TEXT)) == TEXT
    with pytest.raises(DataError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


# ---- sources ---------------------------------------------------------------------------------


def test_stdlib_source_finds_files_and_excludes_tests_and_site_packages(tmp_path):
    root, rel = stdlib_files()
    assert len(rel) > 300 and "os.py" in rel and rel == sorted(rel, key=lambda p: p.replace(os.sep, "/"))
    assert all(p.endswith(".py") and not set(p.split(os.sep)[:-1]) & STDLIB_EXCLUDE for p in rel)
    excluded = [
        p
        for p in ("test/__init__.py", "idlelib/idle_test/__init__.py", "site-packages/README.txt")
        if os.path.exists(os.path.join(root, p))
    ]
    assert excluded and not any(p.replace("/", os.sep) in rel for p in excluded)
    assert not any(p.startswith(("test" + os.sep, "site-packages" + os.sep)) for p in rel)
    cap = os.path.getsize(os.path.join(root, rel[0])) + 100
    cfg = _cfg(tmp_path, max_bytes=cap)
    check_source(cfg)
    docs = list(iter_documents(cfg))
    with open(os.path.join(root, rel[0]), encoding="utf-8", errors="replace") as f:
        assert docs[0] == f.read()
    assert sum(len(d.encode()) for d in docs) == cap and len(docs) == 2
    corpus = load_corpus(cfg, ByteTokenizer())
    assert len(corpus.train) + len(corpus.val) == cap + 2  # bytes plus one eos per document
    assert len(corpus.val) == len(docs[1].encode()) + 1  # the last document is held out
    assert "stdlib" in corpus.describe() and "documents" in corpus.describe()


def test_text_file_and_glob(tmp_path):
    docs = ["first document\n", "второй документ\n", "third one " * 30]
    _write_docs(tmp_path, docs)
    (tmp_path / "other.md").write_text("not matched")
    tok = ByteTokenizer()
    one = load_corpus(_cfg(tmp_path, source=str(tmp_path / "doc01.txt"), val_fraction=0.0), tok)
    assert one.train.tolist() == tok.encode(docs[1]) + [256] and len(one.val) == 0
    many = load_corpus(_cfg(tmp_path, source=str(tmp_path / "doc*.txt"), val_fraction=0.0), tok)
    assert many.train.tolist() == [i for d in docs for i in tok.encode(d) + [256]]
    assert many.documents == 3 and many.bytes == sum(len(d.encode()) for d in docs) and many.train.dtype == np.uint16
    capped = list(iter_documents(_cfg(tmp_path, source=str(tmp_path / "doc*.txt"), max_bytes=20)))
    assert capped == [docs[0], docs[1].encode()[:5].decode("utf-8", "ignore")]  # cut inside a 2-byte character


def test_jsonl_source_and_bad_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "alpha"}\n\n{"body": "x", "text": "βeta"}\n')
    tok = ByteTokenizer()
    assert list(iter_documents(_cfg(tmp_path, source=str(p)))) == ["alpha", "βeta"]
    c = load_corpus(_cfg(tmp_path, source=str(p), val_fraction=0.0), tok)
    assert c.train.tolist() == tok.encode("alpha") + [256] + tok.encode("βeta") + [256]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        load_corpus(_cfg(tmp_path, source=str(bad)), tok)
    with pytest.raises(DataError, match=r"d\.jsonl:1.*'body'"):
        list(iter_documents(_cfg(tmp_path, source=str(p), text_field="body")))


def test_token_files(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 257
    ids.tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", ids[:300].astype(np.int32))
    tok = ByteTokenizer()
    c = load_corpus(_cfg(tmp_path, source=str(tmp_path / "a.bin"), val_fraction=0.1), tok)
    assert (
        isinstance(c.train, np.memmap) and len(c.val) == 100 and np.array_equal(np.concatenate([c.train, c.val]), ids)
    )
    c = load_corpus(_cfg(tmp_path, source=str(tmp_path / "b.npy"), val_fraction=0.0), tok)
    assert c.train.tolist() == ids[:300].tolist()
    (ids[:10].astype(np.uint16)).tofile(tmp_path / "c.bin")
    both = load_corpus(_cfg(tmp_path, source=str(tmp_path / "[ac].bin"), val_fraction=0.0), tok)
    assert both.train.tolist() == ids.tolist() + ids[:10].tolist()
    np.array([5, 999], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match="big.bin"):
        load_corpus(_cfg(tmp_path, source=str(tmp_path / "big.bin")), tok)
    with pytest.raises(DataError, match="token file"):
        build_tokenizer(_cfg(tmp_path, source=str(tmp_path / "a.bin"), tokenizer="bpe"))


def test_missing_source_is_a_data_error(tmp_path):
    for source in (str(tmp_path / "nope.txt"), str(tmp_path / "*.nothing")):
        for call in (check_source, lambda c: load_corpus(c, ByteTokenizer())):
            with pytest.raises(DataError, match="nope.txt|\\*.nothing"):
                call(_cfg(tmp_path, source=source))


def test_val_split_is_whole_documents_from_the_end(tmp_path):
    docs = [f"document {i} " * (5 + 7 * i) for i in range(8)]
    _write_docs(tmp_path, docs)
    tok = ByteTokenizer()
    c = load_corpus(_cfg(tmp_path, source=str(tmp_path / "doc*.txt"), val_fraction=0.2), tok)
    per_doc = [tok.encode(d) + [256] for d in docs]
    total = sum(map(len, per_doc))
    k = next(k for k in range(1, 8) if sum(map(len, per_doc[-k:])) >= 0.2 * total)
    assert c.val.tolist() == [i for d in per_doc[-k:] for i in d]  # whole documents, in order
    assert c.train.tolist() == [i for d in per_doc[:-k] for i in d] and c.val[-1] == 256
    # at least one document even for a tiny fraction; never all of them; one document: cut the stream
    assert split_point([10, 10, 10], 1e-6) == 20 and split_point([1, 100], 0.99) == 1 and split_point([100], 0.1) == 90
    assert split_point([10, 10], 0.0) == 20
    assert split_point([10, 100], 0.01) == 108  # a last document larger than the rest: cut the stream


def test_corpus_cache_is_hit_on_second_load(tmp_path, monkeypatch):
    _write_docs(tmp_path, ["cache me " * 50, "and me " * 50])
    cfg = _cfg(tmp_path, source=str(tmp_path / "doc*.txt"), val_fraction=0.3)
    tok = ByteTokenizer()
    first = load_corpus(cfg, tok)
    assert len(os.listdir(tmp_path / "cache" / "corpus")) == 2  # tokens .npy + summary .json, no temp files left
    calls = []
    encode = ByteTokenizer.encode_documents
    monkeypatch.setattr(
        ByteTokenizer, "encode_documents", lambda self, texts: calls.append(len(texts)) or encode(self, texts)
    )
    second = load_corpus(cfg, tok)
    assert calls == [] and isinstance(second.train, np.memmap)
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert second.describe() == first.describe()
    (tmp_path / "doc01.txt").write_text("changed")  # a changed source is tokenized again
    assert load_corpus(cfg, tok).documents == 2 and calls == [2]


# ---- loader ----------------------------------------------------------------------------------

SEQ, N_WINDOWS = 8, 30
TOKENS = np.arange(SEQ * N_WINDOWS + 1 + 3, dtype=np.uint16)  # 3 spare tokens: still 30 windows


def _global_rows(loader: ShardedBatches, consumed: int, batch: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = loader.micro_batches(consumed, batch, micro)
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def test_windows_inputs_and_targets():
    b = ShardedBatches(TOKENS, SEQ, seed=0)
    assert b.n_windows == N_WINDOWS
    x, y = _global_rows(b, 0, 6, 2)
    assert x.shape == (6, SEQ) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    starts = x[:, 0] // SEQ
    assert torch.equal(x[:, 0] % SEQ, torch.zeros(6, dtype=torch.int64))
    assert torch.equal(starts, torch.from_numpy(b.permutation(0)[:6]))


def test_epoch_permutation_visits_every_window_once():
    b = ShardedBatches(TOKENS, SEQ, seed=5)
    seen = [b.windows(g, 1)[0] for g in range(3 * N_WINDOWS)]
    for e in range(3):
        assert sorted(seen[e * N_WINDOWS : (e + 1) * N_WINDOWS]) == list(range(N_WINDOWS))
    assert seen[:N_WINDOWS] != seen[N_WINDOWS : 2 * N_WINDOWS]  # a fresh order each epoch
    assert not np.array_equal(b.permutation(0), ShardedBatches(TOKENS, SEQ, seed=6).permutation(0))


def test_determinism_resume_and_dp_slicing():
    batch, micro = 8, 2
    one = ShardedBatches(TOKENS, SEQ, seed=1234)
    steps = [_global_rows(one, s * batch, batch, micro) for s in range(9)]  # crosses two epoch boundaries
    fresh = ShardedBatches(TOKENS, SEQ, seed=1234)  # resume: a new loader at consumed gives the same batch
    for s in (7, 3, 8):
        assert all(torch.equal(a, b) for a, b in zip(_global_rows(fresh, s * batch, batch, micro), steps[s]))
    for dp in (2, 4):
        ranks = [ShardedBatches(TOKENS, SEQ, seed=1234, dp_rank=r, dp_size=dp) for r in range(dp)]
        for s in (0, 4, 8):
            rows = [_global_rows(r, s * batch, batch, micro) for r in ranks]
            assert torch.equal(torch.cat([x for x, _ in rows]), steps[s][0])
            assert torch.equal(torch.cat([y for _, y in rows]), steps[s][1])
            assert all(len(r.micro_batches(s * batch, batch, micro)) == batch // dp // micro for r in ranks)


def test_each_rank_reads_only_its_rows():
    class Spy(np.ndarray):
        reads: list = []

        def __getitem__(self, index):
            Spy.reads.append(np.asarray(index).copy())
            return np.asarray(self)[index]

    spy = TOKENS.view(Spy)
    b = ShardedBatches(spy, SEQ, seed=3, dp_rank=1, dp_size=4)
    b.micro_batches(16, 8, 1)
    read = np.unique(np.concatenate([r.ravel() for r in Spy.reads]))
    assert len(read) <= 2 * (SEQ + 1)  # two rows of one window each
    assert np.array_equal(np.unique(b.windows(16 + 2, 2)[:, None] * SEQ + np.arange(SEQ + 1)), read)


def test_val_batches_are_unshuffled_and_wrap():
    b = ShardedBatches(TOKENS, SEQ, seed=9)
    x = torch.cat([m[0] for m in b.val_micro_batches(3, 8, 4)])
    assert (x[:, 0] // SEQ).tolist() == [(24 + j) % N_WINDOWS for j in range(8)]
    r1 = ShardedBatches(TOKENS, SEQ, seed=9, dp_rank=1, dp_size=2).val_micro_batches(3, 8, 2)
    assert torch.equal(torch.cat([m[0] for m in r1]), x[4:])


def test_loader_errors():
    with pytest.raises(DataError, match="train.*data.seq_len"):
        ShardedBatches(TOKENS[:SEQ], SEQ, seed=0).micro_batches(0, 2, 1)
    with pytest.raises(DataError, match="val"):
        ShardedBatches(TOKENS[:SEQ], SEQ, seed=0).val_micro_batches(0, 2, 1)
    b = ShardedBatches(TOKENS, SEQ, seed=0, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="divisible by the data-parallel size"):
        b.micro_batches(0, 6, 1)
    with pytest.raises(ValueError, match="micro_batch"):
        b.micro_batches(0, 8, 3)
