"""The tokenized corpus cached from the source's documents (:mod:`trickles.data.sources`), split into train and val.

:func:`load_corpus` tokenizes every document, appends eos after each and concatenates them into one array, written once
(streamed, then renamed into place) to ``<cache>/corpus/<key>.npy`` with its summary in ``<key>.json``; later loads
memory-map it. The key hashes the file list (paths, sizes, mtimes), the tokenizer's identity, ``max_bytes``,
``val_fraction``, ``text_field`` and ``format`` (and the label settings). With labels (hard-routed experts), each
document's label comes from ``data.label_field`` (JSONL) or its path (``data.label_path``); documents whose label the
experts are not mapped for are left out, and each token's label id is written beside the tokens (``<key>.labels.npy``,
uint16). The validation split is whole documents taken from the end of the document list, together at least
``val_fraction`` of the tokens (at least one document when ``val_fraction > 0``, never all of them). The token stream
itself is cut instead (the last ``val_fraction`` of the tokens) when there is a single document, or when whole documents
would hold out more tokens than they leave for training (one huge last document) while ``val_fraction < 0.5``. A token
file is always cut this way.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from . import chat
from .config import DataConfig
from .loader import require_boundaries
from .sources import Format, labelled_documents, resolve_files, resolve_format, source_fingerprint
from .tokenizers import Tokenizer, build_tokenizer, cache_root

_BATCH_CHARS = 8 << 20  # documents are tokenized in batches of about this much text
_CACHE_VERSION = 1


@dataclass
class Corpus:
    """Training and held-out tokens (1-D integer arrays, memory-mapped when cached)."""

    train: np.ndarray
    val: np.ndarray
    source: str = ""
    documents: int | None = None
    bytes: int | None = None
    tokenizer: str = ""
    train_labels: np.ndarray | None = None  # with labels: each token's document label id, aligned with ``train``
    val_labels: np.ndarray | None = None
    label_documents: dict[str, int] | None = None  # documents per label read
    train_flags: np.ndarray | None = None  # chat data: each token's flags (trickles.data.chat), aligned with ``train``
    val_flags: np.ndarray | None = None
    chat: dict[str, int] | None = None  # chat data: conversations, sequences, truncated, dropped, untrained
    overlong: str = "truncate"

    def describe(self) -> str:
        """One line: source, documents, bytes, tokens train/val, tokenizer."""
        parts = [self.source or "corpus"]
        if self.documents is not None:
            parts.append(f"{self.documents:,} documents")
        if self.bytes is not None:
            parts.append(f"{self.bytes / 1e6:.1f} MB")
        parts.append(f"{len(self.train):,} train / {len(self.val):,} val tokens")
        if self.tokenizer:
            parts.append(f"tokenizer {self.tokenizer}")
        if self.chat is not None:
            parts.append(chat.describe(self.chat, self.overlong))
        if self.label_documents:
            parts.append("labels " + ", ".join(f"{k} ({v} docs)" for k, v in self.label_documents.items()))
        return ", ".join(parts)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies up to 65535 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def split_point(doc_tokens: list[int], val_fraction: float) -> int:
    """Where the validation split starts in the concatenated tokens (see module doc)."""
    total = sum(doc_tokens)
    if val_fraction <= 0 or total == 0:
        return total
    stream = total - min(total - 1, max(1, math.ceil(val_fraction * total)))
    if len(doc_tokens) == 1:
        return stream
    need, held, k = val_fraction * total, 0, 0
    while k < len(doc_tokens) - 1 and (k == 0 or held < need):
        k += 1
        held += doc_tokens[-k]
    if held > total - held and val_fraction < 0.5:  # one huge last document would outweigh training
        return stream
    return total - held


class _NpyWriter:
    """Streams a 1-D array into a ``.npy`` file (temp name, renamed into place by :meth:`commit`)."""

    def __init__(self, path: str, dtype: np.dtype):
        self.path, self.dtype, self.n = path, np.dtype(dtype), 0
        fd, self.tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=os.path.dirname(path))
        self.f = os.fdopen(fd, "wb")
        self.f.write(self._header(0))

    def _header(self, n: int) -> bytes:
        b = io.BytesIO()
        descr = np.lib.format.dtype_to_descr(self.dtype)
        np.lib.format.write_array_header_1_0(b, {"descr": descr, "fortran_order": False, "shape": (n,)})
        return b.getvalue()

    def write(self, arr: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(arr, dtype=self.dtype).tobytes())
        self.n += len(arr)

    def commit(self) -> None:
        header = self._header(self.n)
        if len(header) != len(self._header(0)):  # numpy pads the header so that it cannot grow; be sure
            raise RuntimeError("npy header length changed while streaming")
        self.f.seek(0)
        self.f.write(header)
        self.f.close()
        os.chmod(self.tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def _open_token_file(cfg: DataConfig, path: str) -> np.ndarray:
    try:
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            arr = (
                np.memmap(path, dtype=cfg.token_dtype, mode="r")
                if os.path.getsize(path)
                else np.zeros(0, cfg.token_dtype)
            )
    except (OSError, ValueError) as e:
        raise DataError(
            f"data.source: cannot read token file {path} ({e}); check the file and data.token_dtype"
        ) from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"data.source: {path} holds {arr.dtype}, not integer token ids; save the tokens as integers")
    return arr.reshape(-1)


def check_boundaries(cfg: DataConfig) -> None:
    """Before any process starts: with ``data.document_mask``, the tokenizer has an end-of-text id (loading it
    refuses one without) and each token file holds it somewhere (else it was written without document
    boundaries). Text sources get an eos after every document; a BPE still to be trained is checked by the
    trainer instead (:func:`~trickles.data.loader.require_boundaries`). A chat source: the tokenizer is a Hugging Face
    one with a chat template and every record has a shape chat data takes (:func:`trickles.data.chat.check_chat`)."""
    chats = [one for one in cfg.per_source() if one.format == "chat"]
    if chats and cfg.tokenizer in ("byte", "bpe"):
        chat.chat_template(cfg, None)  # (refuses in one line)
    if not cfg.document_mask or cfg.tokenizer == "bpe":
        return
    tokenizer = build_tokenizer(cfg)
    for one in chats:
        chat.check_chat(one, tokenizer)
    for one in cfg.per_source():  # (every source of a mixture)
        files = resolve_files(one)
        if resolve_format(one, files) == "tokens":
            eos = tokenizer.eos_id
            for f in files:
                require_boundaries(_open_token_file(one, f), eos, f)


def _check_ids(arr: np.ndarray, path: str, tokenizer: Tokenizer) -> None:
    if len(arr) and (int(arr.max()) >= tokenizer.vocab_size or int(arr.min()) < 0):
        raise DataError(
            f"data.source: {path} holds token ids outside 0..{tokenizer.vocab_size - 1} "
            f"(tokenizer {tokenizer.name}); set data.tokenizer to the one the tokens were made with"
        )


def _split(arr: np.ndarray, split: int) -> tuple[np.ndarray, np.ndarray]:
    return arr[:split], arr[split:]


def load_corpus(
    cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | None = None, labels: list[str] | None = None
) -> Corpus:
    """The source tokenized with ``tokenizer`` and split into train/val (cached; see module doc).

    ``cache_dir`` defaults to ``cfg.cache_dir``, then ``~/.cache/trickles``. ``labels`` (hard-routed
    experts): keep only the documents with one of these labels (``data.label_field`` or
    ``data.label_path``) and record each token's label id (its position in ``labels``).
    """
    files = resolve_files(cfg)
    fmt = resolve_format(cfg, files)
    label = "stdlib" if cfg.source == "stdlib" else cfg.source
    if labels is not None and (fmt == "tokens" or (cfg.label_field is None and cfg.label_path == "none")):
        raise DataError(
            "hard-routed experts need each document's label: set data.label_field (a JSONL field) or "
            "data.label_path (package or directory) for a text source"
        )
    if fmt == "tokens" and len(files) == 1:
        arr = _open_token_file(cfg, files[0])
        _check_ids(arr, files[0], tokenizer)
        train, val = _split(arr, split_point([len(arr)], cfg.val_fraction))
        return Corpus(train, val, label, tokenizer=tokenizer.name)

    key_parts = [
        _CACHE_VERSION,
        source_fingerprint(cfg),
        tokenizer.identity(),
        cfg.max_bytes,
        cfg.val_fraction,
        cfg.text_field,
        cfg.format,
        cfg.token_dtype if fmt == "tokens" else None,
    ]
    if labels is not None:
        key_parts += [cfg.label_field, cfg.label_path, list(labels)]
    if fmt == "chat":
        key_parts += chat.cache_key(cfg, chat.chat_template(cfg, tokenizer))
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]
    directory = os.path.join(cache_root(cache_dir if cache_dir is not None else cfg.cache_dir), "corpus")
    npy, meta_path = os.path.join(directory, f"{key}.npy"), os.path.join(directory, f"{key}.json")
    meta = _read_cached(npy, meta_path, fmt == "chat")
    if meta is None:
        os.makedirs(directory, exist_ok=True)
        meta = _tokenize_to(npy, cfg, files, fmt, tokenizer, labels)
        tmp = f"{meta_path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f)
        os.replace(tmp, meta_path)
    arr = np.load(npy, mmap_mode="r")
    train, val = _split(arr, meta["split"])
    corpus = Corpus(train, val, label, meta["documents"], meta["bytes"], tokenizer.name)
    if fmt == "chat":
        corpus.train_flags, corpus.val_flags = _split(np.load(_flags_path(npy), mmap_mode="r"), meta["split"])
        corpus.chat, corpus.overlong = meta["chat"], cfg.overlong
    if labels is not None:
        corpus.train_labels, corpus.val_labels = _split(np.load(_labels_path(npy), mmap_mode="r"), meta["split"])
        corpus.label_documents = meta["label_documents"]
    return corpus


def _labels_path(npy: str) -> str:
    return npy[: -len(".npy")] + ".labels.npy"


def _flags_path(npy: str) -> str:
    return npy[: -len(".npy")] + ".flags.npy"


def _read_cached(npy: str, meta_path: str, flags: bool = False) -> dict | None:
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if np.load(npy, mmap_mode="r").shape == (meta["tokens"],) and (
            not flags or np.load(_flags_path(npy), mmap_mode="r").shape == (meta["tokens"],)
        ):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _tokenize_to(
    npy: str, cfg: DataConfig, files: list[str], fmt: Format, tokenizer: Tokenizer, labels: list[str] | None = None
) -> dict:
    """Writes the concatenated tokens to ``npy`` (and with ``labels`` each token's label id beside it);
    returns ``{tokens, split, documents, bytes}`` (and ``label_documents``)."""
    if fmt == "chat":
        return _chat_to(npy, cfg, files, tokenizer)
    writer = _NpyWriter(npy, token_dtype(tokenizer.vocab_size))
    label_writer = _NpyWriter(_labels_path(npy), np.dtype(np.uint16)) if labels is not None else None
    ids = {name: i for i, name in enumerate(labels or [])}
    per_label = {name: 0 for name in labels or []}
    try:
        if fmt == "tokens":  # several token files: concatenate them
            for path in files:
                arr = _open_token_file(cfg, path)
                _check_ids(arr, path, tokenizer)
                for start in range(0, len(arr), 1 << 24):
                    writer.write(arr[start : start + (1 << 24)])
            if writer.n == 0:
                raise DataError(f"data.source {cfg.source!r} holds no tokens; give non-empty token files")
            split, docs, nbytes = split_point([writer.n], cfg.val_fraction), None, None
        else:
            lengths: list[int] = []
            nbytes, batch, chars, batch_ids = 0, [], 0, []
            for text, n, doc_label in labelled_documents(cfg, set(ids) if label_writer is not None else None):
                if label_writer is not None:  # (documents with labels the experts are not mapped for are left out)
                    per_label[doc_label] += 1
                    batch_ids.append(ids[doc_label])
                nbytes += n
                batch.append(text)
                chars += len(text)
                if chars >= _BATCH_CHARS:
                    lengths += _write_batch(writer, tokenizer, batch, label_writer, batch_ids)
                    batch, chars, batch_ids = [], 0, []
            lengths += _write_batch(writer, tokenizer, batch, label_writer, batch_ids)
            missing = [k for k, v in per_label.items() if v == 0]
            if missing:
                raise DataError(
                    f"no document of data.source {cfg.source!r} has the label(s) {', '.join(missing)} "
                    f"(model.moe_label_experts); fix the labels or data.label_field / data.label_path"
                )
            if not lengths:
                raise DataError(f"data.source {cfg.source!r} holds no text; give a non-empty source")
            split, docs = split_point(lengths, cfg.val_fraction), len(lengths)
        writer.commit()
        if label_writer is not None:
            label_writer.commit()
    except BaseException:
        writer.abort()
        if label_writer is not None:
            label_writer.abort()
        raise
    meta = {"tokens": writer.n, "split": split, "documents": docs, "bytes": nbytes}
    if labels is not None:
        meta["label_documents"] = per_label
    return meta


def _write_batch(
    writer: _NpyWriter,
    tokenizer: Tokenizer,
    batch: list[str],
    label_writer: _NpyWriter | None = None,
    label_ids: list[int] | None = None,
) -> list[int]:
    if not batch:
        return []
    arrays = tokenizer.encode_documents(batch)
    for i, a in enumerate(arrays):
        writer.write(a)
        if label_writer is not None:
            label_writer.write(np.full(len(a), label_ids[i], dtype=np.uint16))
    return [len(a) for a in arrays]


def _chat_to(npy: str, cfg: DataConfig, files: list[str], tokenizer: Tokenizer) -> dict:
    """Writes a chat source's packed sequences to ``npy`` and their flags beside it (:mod:`trickles.data.chat`:
    training sequences, a padding token, held-out sequences, a padding token); returns the meta with the counts."""
    packer = chat.Packer(cfg.seq_len, tokenizer.eos_id, cfg.overlong)
    sequences: list[tuple[np.ndarray, np.ndarray]] = []
    for ids, trained in chat.examples(cfg, tokenizer, files):
        sequences += packer.add(ids, trained)
    sequences += packer.finish()
    if not sequences:
        raise DataError(
            f"data.source {cfg.source!r} holds no conversation with assistant tokens that fits "
            f"(data.overlong={cfg.overlong}); give conversations with assistant messages"
        )
    held = chat.held_out_sequences(len(sequences), cfg.val_fraction)
    pad = (np.array([tokenizer.eos_id], dtype=np.int64), np.array([chat.START], dtype=np.uint8))
    stream = sequences[: len(sequences) - held] + [pad] + sequences[len(sequences) - held :] + [pad]
    writer = _NpyWriter(npy, token_dtype(tokenizer.vocab_size))
    flag_writer = _NpyWriter(_flags_path(npy), np.dtype(np.uint8))
    try:
        for ids, flags in stream:
            writer.write(ids)
            flag_writer.write(flags)
        writer.commit()
        flag_writer.commit()
    except BaseException:
        writer.abort()
        flag_writer.abort()
        raise
    split = (len(sequences) - held) * cfg.seq_len + 1
    return {
        "tokens": writer.n,
        "split": split,
        "documents": packer.counts["conversations"],
        "bytes": None,
        "chat": packer.counts,
    }
