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
``val_fraction``, ``text_field`` and ``format``. The validation split is whole documents taken
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

def _documents(cfg: DataConfig) -> Iterator[tuple[str, int]]:
    """``(text, bytes of text read)`` for every non-empty document, within ``data.max_bytes``."""
    files = resolve_files(cfg)
    if resolve_format(cfg, files) == "tokens":
        raise DataError(f"data.source {cfg.source!r} holds tokens, not text; there are no documents to read")
    left = cfg.max_bytes
    for path in files:
        if left is not None and left <= 0:
            return
        try:
            if file_format(cfg, path) == "jsonl":
                for text, n in _jsonl_documents(cfg, path, left):
                    left = None if left is None else left - n
                    yield text, n
                continue
            with open(path, "rb") as f:
                raw = f.read() if left is None else f.read(left)
        except OSError as e:
            raise DataError(f"data.source: cannot read {path} ({e.strerror}); check the path and its permissions") from None
        if left is not None:
            left -= len(raw)
        if raw:
            yield codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=left is None or left > 0), len(raw)


def _jsonl_documents(cfg: DataConfig, path: str, left: int | None) -> Iterator[tuple[str, int]]:
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
            raw = text.encode("utf-8")
            if left is not None and len(raw) >= left:
                raw = raw[:left]
                text = raw.decode("utf-8", errors="ignore")
            if raw:
                yield text, len(raw)
            if left is not None:
                left -= len(raw)
                if left <= 0:
                    return


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """The source's documents as strings, in order (what a BPE tokenizer trains on)."""
    for text, _ in _documents(cfg):
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


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | None = None) -> Corpus:
    """The source tokenized with ``tokenizer`` and split into train/val (cached; see module doc).

    ``cache_dir`` defaults to ``cfg.cache_dir``, then ``~/.cache/trickles``.
    """
    files = resolve_files(cfg)
    fmt = resolve_format(cfg, files)
    label = "stdlib" if cfg.source == "stdlib" else cfg.source
    if fmt == "tokens" and len(files) == 1:
        arr = _open_token_file(cfg, files[0])
        _check_ids(arr, files[0], tokenizer)
        train, val = _split(arr, split_point([len(arr)], cfg.val_fraction))
        return Corpus(train, val, label, tokenizer=tokenizer.name)

    key_parts = [_CACHE_VERSION, source_fingerprint(cfg), tokenizer.identity(), cfg.max_bytes, cfg.val_fraction,
                 cfg.text_field, cfg.format, cfg.token_dtype if fmt == "tokens" else None]
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]
    directory = os.path.join(cache_root(cache_dir if cache_dir is not None else cfg.cache_dir), "corpus")
    npy, meta_path = os.path.join(directory, f"{key}.npy"), os.path.join(directory, f"{key}.json")
    meta = _read_cached(npy, meta_path)
    if meta is None:
        os.makedirs(directory, exist_ok=True)
        meta = _tokenize_to(npy, cfg, files, fmt, tokenizer)
        tmp = f"{meta_path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f)
        os.replace(tmp, meta_path)
    arr = np.load(npy, mmap_mode="r")
    train, val = _split(arr, meta["split"])
    return Corpus(train, val, label, meta["documents"], meta["bytes"], tokenizer.name)


def _read_cached(npy: str, meta_path: str) -> dict | None:
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if np.load(npy, mmap_mode="r").shape == (meta["tokens"],):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _tokenize_to(npy: str, cfg: DataConfig, files: list[str], fmt: Format, tokenizer: Tokenizer) -> dict:
    """Writes the concatenated tokens to ``npy``; returns ``{tokens, split, documents, bytes}``."""
    writer = _NpyWriter(npy, token_dtype(tokenizer.vocab_size))
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
            nbytes, batch, chars = 0, [], 0
            for text, n in _documents(cfg):
                nbytes += n
                batch.append(text)
                chars += len(text)
                if chars >= _BATCH_CHARS:
                    lengths += _write_batch(writer, tokenizer, batch)
                    batch, chars = [], 0
            lengths += _write_batch(writer, tokenizer, batch)
            if not lengths:
                raise DataError(f"data.source {cfg.source!r} holds no text; give a non-empty source")
            split, docs = split_point(lengths, cfg.val_fraction), len(lengths)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"tokens": writer.n, "split": split, "documents": docs, "bytes": nbytes}


def _write_batch(writer: _NpyWriter, tokenizer: Tokenizer, batch: list[str]) -> list[int]:
    if not batch:
        return []
    arrays = tokenizer.encode_documents(batch)
    for a in arrays:
        writer.write(a)
    return [len(a) for a in arrays]
