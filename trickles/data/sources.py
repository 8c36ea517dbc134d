"""Where the text comes from, and the tokenized corpus cached from it.

``data.source`` is one of:

* ``"stdlib"`` — the running Python's standard-library source: every ``*.py`` below
  ``sysconfig.get_paths()["stdlib"]``, sorted by relative path, leaving out anything under
  ``site-packages``/``dist-packages`` and test directories (``test``, ``tests``, ``idle_test``);
* a text file, or a glob of them (sorted) — each file is one document;
* a ``.jsonl`` file (or glob) — one JSON object per line, the text under ``data.text_field``;
* a token file (or glob) — ``.bin``: a raw array of ``data.token_dtype``; ``.npy``: read with
  ``np.load(mmap_mode="r")``. These are already tokenized; the tokenizer only decodes samples.

``data.format = "auto"`` decides per file by extension (``.jsonl`` -> jsonl, ``.bin``/``.npy``
-> tokens, anything else -> text). Text is read as UTF-8 with undecodable bytes replaced;
empty documents are skipped; ``data.max_bytes`` stops reading after that many bytes of text
(the last document is cut), and does not apply to token files.

:func:`load_corpus` tokenizes every document, appends eos after each and concatenates them into
one array, written once (streamed, then renamed into place) to
``<cache>/corpus/<key>.npy`` with its summary in ``<key>.json``; later loads memory-map it. The
key hashes the file list (paths, sizes, mtimes), the tokenizer's identity, ``max_bytes``,
``val_fraction``, ``text_field`` and ``format`` (and the label settings). With labels (hard-routed
experts), each document's label comes from ``data.label_field`` (JSONL) or its path
(``data.label_path``); documents whose label the experts are not mapped for are left out, and each
token's label id is written beside the tokens (``<key>.labels.npy``, uint16). The validation split is whole documents taken
from the end of the document list, together at least ``val_fraction`` of the tokens (at least
one document when ``val_fraction > 0``, never all of them). The token stream itself is cut
instead (the last ``val_fraction`` of the tokens) when there is a single document, or when
whole documents would hold out more tokens than they leave for training (one huge last
document) while ``val_fraction < 0.5``. A token file is always cut this way.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import io
import json
import math
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Literal

import numpy as np

from ..errors import DataError
from .config import DataConfig
from .tokenizers import cache_root

if TYPE_CHECKING:
    from .tokenizers import Tokenizer

Format = Literal["text", "jsonl", "tokens"]
STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_BATCH_CHARS = 8 << 20  # documents are tokenized in batches of about this much text
_CACHE_VERSION = 1


# ---- files -------------------------------------------------------------------------------

def stdlib_files() -> tuple[str, list[str]]:
    """``(root, sorted relative paths)`` of the standard library's ``*.py`` files (see module doc)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_EXCLUDE]
        rel = os.path.relpath(here, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    return root, sorted(found, key=lambda p: p.replace(os.sep, "/"))


def _is_glob(source: str) -> bool:
    return any(c in source for c in "*?[")


def resolve_files(cfg: DataConfig) -> list[str]:
    """The files ``data.source`` names, in document order; DataError when there are none."""
    if cfg.source == "stdlib":
        root, rel = stdlib_files()
        if not rel:
            raise DataError(f"data.source 'stdlib': no *.py files under {root}; give a text file, a glob or a .jsonl file")
        return [os.path.join(root, r) for r in rel]
    pattern = os.path.expanduser(cfg.source)
    if _is_glob(pattern):
        files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    else:
        files = [pattern] if os.path.isfile(pattern) else []
    if not files:
        what = "matches no file" if _is_glob(pattern) else "is not a file"
        raise DataError(f"data.source {cfg.source!r} {what}; give an existing file, a glob, a .jsonl file, "
                        "a token file, or 'stdlib'")
    return files


def file_format(cfg: DataConfig, path: str) -> Format:
    """How ``path`` is read: ``data.format``, or by extension when it is ``"auto"``."""
    if cfg.format != "auto":
        return cfg.format
    ext = os.path.splitext(path)[1].lower()
    return "jsonl" if ext == ".jsonl" else "tokens" if ext in (".bin", ".npy") else "text"


def resolve_format(cfg: DataConfig, files: list[str] | None = None) -> Format:
    """``"tokens"`` when every file is a token file, else ``"text"``/``"jsonl"``; mixing is a DataError."""
    if cfg.source == "stdlib":
        return "text"
    formats = {file_format(cfg, f) for f in (files if files is not None else resolve_files(cfg))}
    if "tokens" in formats and len(formats) > 1:
        raise DataError(f"data.source {cfg.source!r} mixes token files (.bin/.npy) with text; "
                        "point it at one kind only")
    return "jsonl" if formats == {"jsonl"} else formats.pop() if len(formats) == 1 else "text"


def check_source(cfg: DataConfig) -> None:
    """Cheap checks, before any process starts, that the source (and a tokenizer path) exist."""
    files = resolve_files(cfg)
    fmt = resolve_format(cfg, files)
    for f in files if cfg.source != "stdlib" else ():
        if not os.access(f, os.R_OK):
            raise DataError(f"data.source: {f} is not readable; fix its permissions or choose another file")
        if fmt == "tokens" and not f.endswith(".npy"):
            size = np.dtype(cfg.token_dtype).itemsize
            if os.path.getsize(f) % size:
                raise DataError(f"data.source: {f} is {os.path.getsize(f)} bytes, not a whole number of "
                                f"{cfg.token_dtype} tokens; check data.token_dtype")
    if cfg.tokenizer not in ("byte", "bpe"):
        path = os.path.expanduser(cfg.tokenizer)
        if not (os.path.isfile(os.path.join(path, "tokenizer.json")) or path.endswith(".json") and os.path.isfile(path)):
            raise DataError(f"data.tokenizer {cfg.tokenizer!r} is neither 'byte', 'bpe' nor a directory holding "
                            "tokenizer.json; give one of those")


def source_fingerprint(cfg: DataConfig) -> list:
    """What identifies the source's content cheaply: format, field and ``[path, size, mtime_ns]`` per file."""
    entries = []
    for f in resolve_files(cfg):
        st = os.stat(f)
        entries.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return [cfg.source, cfg.format, cfg.text_field, entries]


# ---- documents ---------------------------------------------------------------------------

def source_root(cfg: DataConfig) -> str:
    """The directory a file source's paths are taken relative to (the stdlib root, a glob's fixed part)."""
    if cfg.source == "stdlib":
        return sysconfig.get_paths()["stdlib"]
    pattern = os.path.expanduser(cfg.source)
    if not _is_glob(pattern):
        return os.path.dirname(os.path.abspath(pattern))
    fixed = pattern[:min(pattern.index(c) for c in "*?[" if c in pattern)]
    return os.path.abspath(fixed if fixed.endswith(os.sep) else os.path.dirname(fixed))


def path_label(cfg: DataConfig, root: str, path: str) -> str:
    """A file document's label by ``data.label_path``: ``package`` -- the first part of its path below ``root``
    (a top-level module's own name without ``.py``); ``directory`` -- its parent directory's name."""
    if cfg.label_path == "directory":
        return os.path.basename(os.path.dirname(os.path.abspath(path)))
    first = os.path.relpath(os.path.abspath(path), root).split(os.sep)[0]
    return first[:-3] if first.endswith(".py") else first


def _documents(cfg: DataConfig, keep: set[str] | None = None) -> Iterator[tuple[str, int, str | None]]:
    """``(text, bytes of text read, label or None)`` for every non-empty document, within ``data.max_bytes``;
    ``keep``: only the documents with one of these labels (the others are not read, nor counted)."""
    files = resolve_files(cfg)
    if resolve_format(cfg, files) == "tokens":
        raise DataError(f"data.source {cfg.source!r} holds tokens, not text; there are no documents to read")
    left = cfg.max_bytes
    root = source_root(cfg) if cfg.label_path != "none" else None
    for path in files:
        if left is not None and left <= 0:
            return
        try:
            if file_format(cfg, path) == "jsonl":
                for text, n, label in _jsonl_documents(cfg, path, left, keep):
                    left = None if left is None else left - n
                    yield text, n, label
                continue
            label = path_label(cfg, root, path) if root is not None else None
            if keep is not None and label not in keep:
                continue
            with open(path, "rb") as f:
                raw = f.read() if left is None else f.read(left)
        except OSError as e:
            raise DataError(f"data.source: cannot read {path} ({e.strerror}); check the path and its permissions") from None
        if left is not None:
            left -= len(raw)
        if raw:
            text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=left is None or left > 0)
            yield text, len(raw), label


def _jsonl_documents(cfg: DataConfig, path: str, left: int | None, keep: set[str] | None = None) -> Iterator[tuple[str, int, str | None]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e}); fix or remove that line") from None
            if not isinstance(record, dict) or not isinstance(record.get(cfg.text_field), str):
                raise DataError(f"{path}:{lineno}: no string field {cfg.text_field!r}; fix the line or set data.text_field")
            text = record[cfg.text_field]
            label = None
            if cfg.label_field is not None:
                if not isinstance(record.get(cfg.label_field), (str, int)):
                    raise DataError(f"{path}:{lineno}: no label field {cfg.label_field!r}; fix the line or set data.label_field")
                label = str(record[cfg.label_field])
                if keep is not None and label not in keep:
                    continue
            raw = text.encode("utf-8")
            if left is not None and len(raw) >= left:
                raw = raw[:left]
                text = raw.decode("utf-8", errors="ignore")
            if raw:
                yield text, len(raw), label
            if left is not None:
                left -= len(raw)
                if left <= 0:
                    return


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """The source's documents as strings, in order (what a BPE tokenizer trains on)."""
    for text, _, _ in _documents(cfg):
        yield text


# ---- the tokenized corpus ----------------------------------------------------------------

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
            arr = np.memmap(path, dtype=cfg.token_dtype, mode="r") if os.path.getsize(path) else np.zeros(0, cfg.token_dtype)
    except (OSError, ValueError) as e:
        raise DataError(f"data.source: cannot read token file {path} ({e}); check the file and data.token_dtype") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"data.source: {path} holds {arr.dtype}, not integer token ids; save the tokens as integers")
    return arr.reshape(-1)


def _check_ids(arr: np.ndarray, path: str, tokenizer: Tokenizer) -> None:
    if len(arr) and (int(arr.max()) >= tokenizer.vocab_size or int(arr.min()) < 0):
        raise DataError(f"data.source: {path} holds token ids outside 0..{tokenizer.vocab_size - 1} "
                        f"(tokenizer {tokenizer.name}); set data.tokenizer to the one the tokens were made with")


def _split(arr: np.ndarray, split: int) -> tuple[np.ndarray, np.ndarray]:
    return arr[:split], arr[split:]


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | None = None, labels: list[str] | None = None) -> Corpus:
    """The source tokenized with ``tokenizer`` and split into train/val (cached; see module doc).

    ``cache_dir`` defaults to ``cfg.cache_dir``, then ``~/.cache/trickles``. ``labels`` (hard-routed
    experts): keep only the documents with one of these labels (``data.label_field`` or
    ``data.label_path``) and record each token's label id (its position in ``labels``).
    """
    files = resolve_files(cfg)
    fmt = resolve_format(cfg, files)
    label = "stdlib" if cfg.source == "stdlib" else cfg.source
    if labels is not None and (fmt == "tokens" or (cfg.label_field is None and cfg.label_path == "none")):
        raise DataError("hard-routed experts need each document's label: set data.label_field (a JSONL field) or "
                        "data.label_path (package or directory) for a text source")
    if fmt == "tokens" and len(files) == 1:
        arr = _open_token_file(cfg, files[0])
        _check_ids(arr, files[0], tokenizer)
        train, val = _split(arr, split_point([len(arr)], cfg.val_fraction))
        return Corpus(train, val, label, tokenizer=tokenizer.name)

    key_parts = [_CACHE_VERSION, source_fingerprint(cfg), tokenizer.identity(), cfg.max_bytes, cfg.val_fraction,
                 cfg.text_field, cfg.format, cfg.token_dtype if fmt == "tokens" else None]
    if labels is not None:
        key_parts += [cfg.label_field, cfg.label_path, list(labels)]
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]
    directory = os.path.join(cache_root(cache_dir if cache_dir is not None else cfg.cache_dir), "corpus")
    npy, meta_path = os.path.join(directory, f"{key}.npy"), os.path.join(directory, f"{key}.json")
    meta = _read_cached(npy, meta_path)
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
    if labels is not None:
        corpus.train_labels, corpus.val_labels = _split(np.load(_labels_path(npy), mmap_mode="r"), meta["split"])
        corpus.label_documents = meta["label_documents"]
    return corpus


def _labels_path(npy: str) -> str:
    return npy[:-len(".npy")] + ".labels.npy"


def _read_cached(npy: str, meta_path: str) -> dict | None:
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if np.load(npy, mmap_mode="r").shape == (meta["tokens"],):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _tokenize_to(npy: str, cfg: DataConfig, files: list[str], fmt: Format, tokenizer: Tokenizer,
                 labels: list[str] | None = None) -> dict:
    """Writes the concatenated tokens to ``npy`` (and with ``labels`` each token's label id beside it);
    returns ``{tokens, split, documents, bytes}`` (and ``label_documents``)."""
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
                    writer.write(arr[start:start + (1 << 24)])
            if writer.n == 0:
                raise DataError(f"data.source {cfg.source!r} holds no tokens; give non-empty token files")
            split, docs, nbytes = split_point([writer.n], cfg.val_fraction), None, None
        else:
            lengths: list[int] = []
            nbytes, batch, chars, batch_ids = 0, [], 0, []
            for text, n, doc_label in _documents(cfg, set(ids) if label_writer is not None else None):
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
                raise DataError(f"no document of data.source {cfg.source!r} has the label(s) {', '.join(missing)} "
                                f"(model.moe_label_experts); fix the labels or data.label_field / data.label_path")
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


def _write_batch(writer: _NpyWriter, tokenizer: Tokenizer, batch: list[str], label_writer: _NpyWriter | None = None,
                 label_ids: list[int] | None = None) -> list[int]:
    if not batch:
        return []
    arrays = tokenizer.encode_documents(batch)
    for i, a in enumerate(arrays):
        writer.write(a)
        if label_writer is not None:
            label_writer.write(np.full(len(a), label_ids[i], dtype=np.uint16))
    return [len(a) for a in arrays]
