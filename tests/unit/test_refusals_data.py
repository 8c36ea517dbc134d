"""Every refusal of a data source or tokenizer is pinned: a missing, empty, mixed, damaged or unlabelled source and an
unreadable or incomplete tokenizer each raise a DataError naming what to fix (docs/testing.md, "Refusals"). Tiny files
under tmp_path; the corpus cache goes there too."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from trickles.data import ByteTokenizer, DataConfig, HFTokenizer, check_source, load_corpus, load_tokenizer, sources
from trickles.data.sources import labelled_documents, resolve_format
from trickles.data.tokenizers import load_hf_tokenizer
from trickles.errors import DataError


def _raises(message):
    return pytest.raises(DataError, match=re.escape(message))


def _cfg(tmp_path, source, **kw):
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def _load(cfg, labels=None):
    return load_corpus(cfg, ByteTokenizer(), labels=labels)


# ---- sources -----------------------------------------------------------------------------------------------------


def test_a_stdlib_without_python_files_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "stdlib_files", lambda: (str(tmp_path), []))
    with _raises("data.source 'stdlib': no *.py files under"):
        check_source(DataConfig(source="stdlib"))


def test_token_files_mixed_with_text_are_refused(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\0\0")
    (tmp_path / "b.txt").write_text("hello")
    with _raises("mixes token files (.bin/.npy) with text; point it at one kind only"):
        resolve_format(_cfg(tmp_path, tmp_path / "*"))


def test_an_unreadable_source_is_refused(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("hello")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root reads any file: ask as if it could not
    with _raises("is not readable; fix its permissions or choose another file"):
        check_source(_cfg(tmp_path, tmp_path / "a.txt"))


def test_a_token_file_that_is_not_whole_tokens_is_refused(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\0\0\0")
    with _raises("a.bin is 3 bytes, not a whole number of uint16 tokens; check data.token_dtype"):
        check_source(_cfg(tmp_path, tmp_path / "a.bin"))


def test_documents_of_a_token_source_are_refused(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\0\0")
    with _raises("holds tokens, not text; there are no documents to read"):
        next(labelled_documents(_cfg(tmp_path, tmp_path / "a.bin")))


def test_a_source_file_that_vanished_is_refused_by_name(tmp_path, monkeypatch):
    gone = str(tmp_path / "gone.txt")
    monkeypatch.setattr(sources, "resolve_files", lambda cfg: [gone])
    with _raises(f"data.source: cannot read {gone} ("):
        next(labelled_documents(_cfg(tmp_path, gone)))


def test_a_jsonl_line_without_its_label_is_refused(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "a", "label": "x"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with _raises("docs.jsonl:2: no label field 'label'; fix the line or set data.label_field"):
        list(labelled_documents(_cfg(tmp_path, path, label_field="label")))


# ---- the corpus --------------------------------------------------------------------------------------------------


def test_a_damaged_or_float_token_file_is_refused(tmp_path):
    (tmp_path / "bad.npy").write_bytes(b"not an npy file")
    with _raises("data.source: cannot read token file"):
        _load(_cfg(tmp_path, tmp_path / "bad.npy"))
    np.save(tmp_path / "float.npy", np.zeros(8, dtype=np.float32))
    with _raises("holds float32, not integer token ids; save the tokens as integers"):
        _load(_cfg(tmp_path, tmp_path / "float.npy"))


def test_empty_sources_are_refused(tmp_path):
    for name in ("a.bin", "b.bin"):
        (tmp_path / name).write_bytes(b"")
    with _raises("holds no tokens; give non-empty token files"):
        _load(_cfg(tmp_path, tmp_path / "*.bin"))
    (tmp_path / "empty.txt").write_text("")
    with _raises("holds no text; give a non-empty source"):
        _load(_cfg(tmp_path, tmp_path / "empty.txt"))


def test_hard_routing_refuses_a_source_without_the_labels(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "some text", "label": "json"}) + "\n")
    with _raises("hard-routed experts need each document's label: set data.label_field"):
        _load(_cfg(tmp_path, path), labels=["json"])
    with _raises("no document of data.source"):
        _load(_cfg(tmp_path, path, label_field="label"), labels=["json", "email"])


# ---- tokenizers --------------------------------------------------------------------------------------------------


def _word_level(directory, vocab):
    """A tokenizer.json of a word-level tokenizer over ``vocab`` (no training)."""
    from tokenizers import Tokenizer, models

    os.makedirs(directory, exist_ok=True)
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=vocab[0]))
    tk.save(os.path.join(directory, "tokenizer.json"))
    return tk


def test_a_tokenizer_without_its_end_of_text_token_is_refused(tmp_path):
    tk = _word_level(tmp_path / "tok", ["a", "b"])
    with _raises("tokenizer 'mine' has no token '</s>' for end-of-text"):
        HFTokenizer(tk, "</s>", "hf", "mine")
    with _raises("names no end-of-text token; set eos_token in"):
        load_hf_tokenizer(tmp_path / "tok")


def test_a_damaged_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with _raises("cannot read"):
        load_hf_tokenizer(tmp_path)


def test_a_saved_tokenizer_with_a_damaged_meta_file_is_refused(tmp_path):
    meta = tmp_path / "tokenizer_meta.json"
    meta.write_text("{}")
    with _raises("is unreadable or has no 'kind'; save the tokenizer again"):
        load_tokenizer(tmp_path)
    meta.write_text(json.dumps({"kind": "bpe", "eos_token": "</s>"}))
    with _raises("has no tokenizer.json; save the tokenizer again"):
        load_tokenizer(tmp_path)
    meta.write_text(json.dumps({"kind": "sentencepiece"}))
    with _raises("names an unknown tokenizer kind 'sentencepiece'; expected 'byte', 'bpe' or 'hf'"):
        load_tokenizer(tmp_path)


def test_bpe_without_the_tokenizers_library_is_refused(tmp_path, monkeypatch):
    import sys

    from trickles.data import train_bpe

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with _raises("the 'bpe' and Hugging Face tokenizers need the tokenizers library"):
        train_bpe(["hello"], 300)
