"""Tokenizers: bytes, a byte-level BPE trained here, or a Hugging Face ``tokenizer.json``.

Every tokenizer has ``name``, ``vocab_size`` (ids are ``0 .. vocab_size-1``) and ``eos_id``
(appended after every document), and can ``save`` itself into a directory that
:func:`load_tokenizer` rebuilds it from (a checkpoint keeps one under ``tokenizer/``):

* ``byte`` — ids 0..255 are the UTF-8 bytes, 256 is end-of-text; needs no files.
* ``bpe`` — byte-level BPE trained with the ``tokenizers`` library on the corpus itself, with
  ``<|endoftext|>`` as eos; cached under ``<cache>/tokenizers/`` by a hash of the source
  fingerprint, the vocabulary size and ``max_bytes``.
* a directory holding a Hugging Face ``tokenizer.json``; eos comes from ``tokenizer_config.json``
  or ``special_tokens_map.json`` (``eos_token``), else from a common name (``</s>``, ...).

A saved directory holds ``tokenizer_meta.json`` (``{"kind", "name", "eos_token", "eos_id"}``)
and, for the BPE and Hugging Face kinds, ``tokenizer.json`` plus ``tokenizer_config.json`` (and
``special_tokens_map.json``) so that ``transformers.AutoTokenizer`` can read it too: a Hugging Face tokenizer's as
its source directory had them, so that the copy renders a chat template as the source does
(:mod:`trickles.data.tokenizer_files`); a BPE's minimal.

The ``tokenizers`` library is optional: it is imported only when a BPE or Hugging Face
tokenizer is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import DataError
from .config import DataConfig
from .sources import iter_documents, resolve_format, source_fingerprint
from .tokenizer_files import config_files, find_chat_template, find_eos, find_special, saved_config

META_FILE = "tokenizer_meta.json"
EOS_TEXT = "<|endoftext|>"
_CHUNK_CHARS = 1 << 16  # long documents are encoded in pieces of about this many characters


class Tokenizer:
    """What the rest of trickles needs from a tokenizer (subclasses fill it in)."""

    name: str
    vocab_size: int
    eos_id: int
    chat_template: str | None = None  #: a Jinja chat template (Hugging Face's), when the tokenizer came with one

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt to continue: as :meth:`encode`, except that a Hugging Face model directory's tokenizer
        adds its special tokens (a BOS, say) as transformers does."""
        return self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special and out-of-vocabulary ids are dropped."""
        raise NotImplementedError

    def save(self, directory: str | os.PathLike) -> None:
        """Writes into ``directory`` what :func:`load_tokenizer` needs to rebuild this tokenizer."""
        raise NotImplementedError

    def identity(self) -> str:
        """A string that changes whenever the mapping from text to ids changes (for cache keys)."""
        raise NotImplementedError

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's ids followed by ``eos_id``, as one integer array per text."""
        return [np.asarray(self.encode(t) + [self.eos_id], dtype=np.int64) for t in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, end-of-text 256; vocabulary 257."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in (int(x) for x in ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = []
        for t in texts:
            raw = np.frombuffer(t.encode("utf-8"), dtype=np.uint8)
            arr = np.empty(len(raw) + 1, dtype=np.uint16)
            arr[:-1] = raw
            arr[-1] = self.eos_id
            out.append(arr)
        return out

    def save(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        _write_json(os.path.join(directory, META_FILE), {"kind": "byte", "name": self.name, "eos_id": self.eos_id})

    def identity(self) -> str:
        return "byte"


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (trained BPE or a Hugging Face ``tokenizer.json``) with its eos.

    ``kind`` is ``"bpe"`` or ``"hf"``. Encoding adds no special tokens (no BOS); documents longer
    than about 64K characters are cut at line breaks and encoded in parallel pieces, which can
    only change how the text right at a cut is split.
    """

    #: a model directory's tokenizer (prompts get its special tokens); the BOS text its directory names (chat templates)
    prompt_specials, bos_token = False, None

    def __init__(self, tk: Any, eos_token: str, kind: str, name: str, chat_template: str | None = None):
        eos_id = tk.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(
                f"tokenizer {name!r} has no token {eos_token!r} for end-of-text; add it or name another eos_token"
            )
        self.tk, self.kind, self.name = tk, kind, name
        self.eos_token, self.eos_id = eos_token, int(eos_id)
        vocab = tk.get_vocab(with_added_tokens=True)
        self.vocab_size = max(tk.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        self._identity: str | None = None
        self.chat_template = chat_template
        self.hf_files: dict[str, dict] = {}  # a Hugging Face directory's config files, kept by save (module doc)

    def encode(self, text: str) -> list[int]:
        return list(self.tk.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tk.encode(text, add_special_tokens=self.prompt_specials).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode([i for i in (int(x) for x in ids) if 0 <= i < self.vocab_size], skip_special_tokens=True)

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        pieces: list[str] = []
        owner: list[int] = []
        for d, text in enumerate(texts):
            for piece in _split_long(text):
                pieces.append(piece)
                owner.append(d)
        encode = getattr(self.tk, "encode_batch_fast", self.tk.encode_batch)
        encodings = encode(pieces, add_special_tokens=False) if pieces else []
        per_doc: list[list[np.ndarray]] = [[] for _ in texts]
        for d, enc in zip(owner, encodings):
            per_doc[d].append(np.asarray(enc.ids, dtype=np.int64))
        eos = np.array([self.eos_id], dtype=np.int64)
        return [np.concatenate(parts + [eos]) for parts in per_doc]

    def save(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        _write_text(os.path.join(directory, "tokenizer.json"), self.tk.to_str())
        config = saved_config(self.hf_files, self.eos_token, self.chat_template)
        _write_json(os.path.join(directory, "tokenizer_config.json"), config)
        if "special_tokens_map.json" in self.hf_files:
            _write_json(os.path.join(directory, "special_tokens_map.json"), self.hf_files["special_tokens_map.json"])
        _write_json(
            os.path.join(directory, META_FILE),
            {"kind": self.kind, "name": self.name, "eos_token": self.eos_token, "eos_id": self.eos_id},
        )

    def identity(self) -> str:
        if self._identity is None:
            digest = hashlib.sha256(self.tk.to_str().encode("utf-8")).hexdigest()[:16]
            self._identity = f"{self.kind}:{digest}:{self.eos_id}"
        return self._identity


def _split_long(text: str) -> list[str]:
    """``text`` cut after line breaks into pieces of roughly ``_CHUNK_CHARS`` characters."""
    if len(text) <= 2 * _CHUNK_CHARS:
        return [text]
    pieces, start = [], 0
    while len(text) - start > 2 * _CHUNK_CHARS:
        cut = text.find("\n", start + _CHUNK_CHARS)
        if cut < 0:
            break
        pieces.append(text[start : cut + 1])
        start = cut + 1
    pieces.append(text[start:])
    return pieces


# ---- building and loading ------------------------------------------------------------------


def _tokenizers_lib():
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "the 'bpe' and Hugging Face tokenizers need the tokenizers library; pip install tokenizers "
            "(or set data.tokenizer = 'byte')"
        ) from None
    return tokenizers


def build_tokenizer(cfg: DataConfig, documents: Callable[[], Iterable[str]] | None = None) -> Tokenizer:
    """The tokenizer ``cfg.tokenizer`` names; ``documents()`` supplies the text a BPE trains on.

    ``documents`` defaults to the configured source's documents (:func:`iter_documents`). A
    trained BPE is cached by the configured source's fingerprint, so ``documents`` should yield
    that source's text.
    """
    kind = cfg.tokenizer
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return _cached_bpe(cfg, documents)
    return load_hf_tokenizer(kind, key="data.tokenizer")


def train_bpe(documents: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE with ``vocab_size`` ids (``<|endoftext|>`` is id 0) trained on ``documents``."""
    lib = _tokenizers_lib()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = lib.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(documents, trainer=trainer)
    return HFTokenizer(tk, EOS_TEXT, "bpe", f"bpe-{vocab_size}")


def _cached_bpe(cfg: DataConfig, documents: Callable[[], Iterable[str]] | None) -> Tokenizer:
    _tokenizers_lib()
    if resolve_format(cfg) == "tokens":
        raise DataError(
            f"data.tokenizer 'bpe' must be trained on text, but data.source {cfg.source!r} is a token file; "
            "use the tokenizer the tokens were made with (a directory or 'byte')"
        )
    key = hashlib.sha256(json.dumps([source_fingerprint(cfg), cfg.bpe_vocab_size, cfg.max_bytes]).encode()).hexdigest()[
        :20
    ]
    final = os.path.join(cache_root(cfg.cache_dir), "tokenizers", f"bpe-{cfg.bpe_vocab_size}-{key}")
    if os.path.isfile(os.path.join(final, META_FILE)):
        return load_tokenizer(final)
    tok = train_bpe(documents() if documents is not None else iter_documents(cfg), cfg.bpe_vocab_size)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
    try:
        tok.save(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process got there first; its tokenizer is the same
            if not os.path.isfile(os.path.join(final, META_FILE)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def load_hf_tokenizer(path: str | os.PathLike, key: str = "tokenizer", model_dir: bool = False) -> HFTokenizer:
    """A Hugging Face tokenizer from a directory holding ``tokenizer.json`` (or that file itself); ``model_dir``: a
    model's own, whose prompts get its special tokens (:meth:`HFTokenizer.encode_prompt`)."""
    path = os.fspath(path)
    directory, file = (
        (os.path.dirname(path), path) if os.path.isfile(path) else (path, os.path.join(path, "tokenizer.json"))
    )
    if not os.path.isfile(file):
        raise DataError(
            f"{key} {path!r} is neither 'byte', 'bpe' nor a directory holding tokenizer.json; "
            "give one of those (save a Hugging Face tokenizer with save_pretrained)"
        )
    lib = _tokenizers_lib()
    try:
        tk = lib.Tokenizer.from_file(file)
    except Exception as e:  # the library raises a bare Exception on malformed files
        raise DataError(
            f"{key}: cannot read {file} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "give a tokenizer.json written by the tokenizers library"
        ) from None
    eos = find_eos(directory, tk)
    if eos is None:
        raise DataError(
            f"{key}: the tokenizer in {path} names no end-of-text token; set eos_token in "
            f"{os.path.join(directory, 'tokenizer_config.json')}"
        )
    name = f"hf:{os.path.basename(os.path.normpath(directory)) or directory}"
    out = HFTokenizer(tk, eos, "hf", name, find_chat_template(directory))
    out.hf_files, out.bos_token = config_files(directory), find_special(directory, tk, "bos_token")
    out.prompt_specials = model_dir
    return out


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Rebuilds the tokenizer that :meth:`Tokenizer.save` wrote into ``directory``.

    A directory without ``tokenizer_meta.json`` but with a ``tokenizer.json`` is read as a
    Hugging Face tokenizer directory.
    """
    directory = os.fspath(directory)
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.isfile(meta_path):
        return load_hf_tokenizer(directory, key="tokenizer directory")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        kind = meta["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{meta_path} is unreadable or has no 'kind'; save the tokenizer again") from None
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("bpe", "hf"):
        file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(file):
            raise DataError(f"{directory} has no tokenizer.json; save the tokenizer again")
        tk = _tokenizers_lib().Tokenizer.from_file(file)
        out = HFTokenizer(tk, meta["eos_token"], kind, meta.get("name", kind), find_chat_template(directory))
        out.hf_files, out.bos_token = config_files(directory), find_special(directory, tk, "bos_token")
        return out
    raise DataError(f"{meta_path} names an unknown tokenizer kind {kind!r}; expected 'byte', 'bpe' or 'hf'")


def cache_root(cache_dir: str | None) -> str:
    """``cache_dir``, or ``~/.cache/trickles`` when it is None."""
    return os.path.expanduser(cache_dir) if cache_dir else os.path.join(os.path.expanduser("~"), ".cache", "trickles")


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_json(path: str, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=1) + "\n")
