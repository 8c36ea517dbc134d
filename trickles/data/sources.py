"""Where the text comes from: the files of ``data.source`` and the documents read from them.

``data.source`` is one of:

* ``"stdlib"`` — the running Python's standard-library source: every ``*.py`` below
  ``sysconfig.get_paths()["stdlib"]``, sorted by relative path, leaving out anything under
  ``site-packages``/``dist-packages`` and test directories (``test``, ``tests``, ``idle_test``);
* a text file, or a glob of them (sorted) — each file is one document;
* a ``.jsonl`` file (or glob) — one JSON object per line, the text under ``data.text_field``;
* a ``.parquet`` file (or glob) — the column ``data.text_field``, one document per row; a directory written by
  ``datasets``' ``save_to_disk`` — the same column of its rows (of split ``data.dataset_split`` if it holds several);
  both read by :mod:`trickles.data.formats`;
* with ``data.format = "chat"``, a ``.jsonl``/``.parquet`` file (or glob) or a saved dataset of conversations or
  prompt/completion records (:mod:`trickles.data.chat`);
* a token file (or glob) — ``.bin``: a raw array of ``data.token_dtype``; ``.npy``: read with
  ``np.load(mmap_mode="r")``. These are already tokenized; the tokenizer only decodes samples.

``data.format = "auto"`` decides per file by extension (``.jsonl`` -> jsonl, ``.parquet`` -> parquet,
``.bin``/``.npy`` -> tokens, a saved dataset's directory -> datasets, anything else -> text). Text is read as
UTF-8 with undecodable bytes replaced; empty documents are skipped; ``data.max_bytes`` stops reading after that many
bytes of text (the last document is cut), and does not apply to token files.

The documents are tokenized into the cached corpus by :mod:`trickles.data.corpus`. With a mixture
(``[[data.sources]]``), :func:`check_source`, :func:`source_fingerprint` and :func:`iter_documents` cover every source
(:meth:`~trickles.data.config.DataConfig.per_source`); each source is tokenized into a corpus of its own.
"""

from __future__ import annotations

import codecs
import functools
import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from typing import Literal

import numpy as np

from ..errors import DataError
from .config import DataConfig
from .formats import TABLES, check_table, dataset_files, is_saved_dataset, table_documents, within_budget

Format = Literal["text", "jsonl", "parquet", "datasets", "tokens"]
STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


# ---- files -------------------------------------------------------------------------------


def stdlib_files() -> tuple[str, list[str]]:
    """``(root, sorted relative paths)`` of the standard library's ``*.py`` files (see module doc)."""
    root, found = _walk_stdlib()
    return root, list(found)


@functools.cache
def _walk_stdlib() -> tuple[str, tuple[str, ...]]:
    """The walk behind :func:`stdlib_files`, once per process: the running interpreter's library does not change
    under it, and every trainer, data check and cache key asks (1,000 files, tens of milliseconds each time)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_EXCLUDE]
        rel = os.path.relpath(here, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in files if f.endswith(".py")]
    return root, tuple(sorted(found, key=lambda p: p.replace(os.sep, "/")))


def _is_glob(source: str) -> bool:
    return any(c in source for c in "*?[")


def resolve_files(cfg: DataConfig) -> list[str]:
    """The files ``data.source`` names, in document order; DataError when there are none."""
    if cfg.source == "stdlib":
        root, rel = stdlib_files()
        if not rel:
            raise DataError(
                f"data.source 'stdlib': no *.py files under {root}; give a text file, a glob or a .jsonl file"
            )
        return [os.path.join(root, r) for r in rel]
    pattern = os.path.expanduser(cfg.source)
    if _is_glob(pattern):
        files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(pattern) and cfg.format in ("auto", "datasets", "chat"):
        if not is_saved_dataset(pattern):
            raise DataError(
                f"data.source {cfg.source!r} is a directory but not one written by datasets' save_to_disk (no "
                "dataset_info.json and state.json, nor dataset_dict.json); give a file, a glob or such a directory"
            )
        files = [pattern]
    else:
        files = [pattern] if os.path.isfile(pattern) else []
    if not files:
        what = "matches no file" if _is_glob(pattern) else "is not a file"
        raise DataError(
            f"data.source {cfg.source!r} {what}; give an existing file, a glob, a .jsonl or .parquet file, "
            "a datasets directory, a token file, or 'stdlib'"
        )
    return files


def file_format(cfg: DataConfig, path: str) -> Format:
    """How ``path`` is read: ``data.format``, or by extension when it is ``"auto"``."""
    if cfg.format != "auto":
        return cfg.format
    if os.path.isdir(path):
        return "datasets"
    ext = os.path.splitext(path)[1].lower()
    by_ext = {".jsonl": "jsonl", ".parquet": "parquet", ".bin": "tokens", ".npy": "tokens"}
    return by_ext.get(ext, "text")


def resolve_format(cfg: DataConfig, files: list[str] | None = None) -> Format:
    """``"tokens"`` when every file is a token file, else the files' one format (``"text"`` when they mix kinds of
    text); mixing tokens with text is a DataError. A mixture is ``"tokens"`` when every source is."""
    if cfg.sources:
        kinds = {resolve_format(c) for c in cfg.per_source()}
        return "tokens" if kinds == {"tokens"} else "text"
    if cfg.source == "stdlib":
        return "text"
    formats = {file_format(cfg, f) for f in (files if files is not None else resolve_files(cfg))}
    if "tokens" in formats and len(formats) > 1:
        raise DataError(
            f"data.source {cfg.source!r} mixes token files (.bin/.npy) with text; point it at one kind only"
        )
    return "jsonl" if formats == {"jsonl"} else formats.pop() if len(formats) == 1 else "text"


def check_source(cfg: DataConfig) -> None:
    """Cheap checks, before any process starts, that the source -- every source of a mixture -- (and a tokenizer
    path) exist, and that a parquet file or saved dataset opens and holds ``data.text_field``."""
    for one in cfg.per_source():
        _check_files(one)
    _check_tokenizer(cfg)


def _check_files(cfg: DataConfig) -> None:
    files = resolve_files(cfg)
    fmt = resolve_format(cfg, files)
    for f in files if cfg.source != "stdlib" else ():
        if not os.access(f, os.R_OK):
            raise DataError(f"data.source: {f} is not readable; fix its permissions or choose another file")
        if file_format(cfg, f) in TABLES:
            check_table(cfg, f, file_format(cfg, f), [cfg.text_field])
        if fmt == "tokens" and not f.endswith(".npy"):
            size = np.dtype(cfg.token_dtype).itemsize
            if os.path.getsize(f) % size:
                raise DataError(
                    f"data.source: {f} is {os.path.getsize(f)} bytes, not a whole number of "
                    f"{cfg.token_dtype} tokens; check data.token_dtype"
                )


def _check_tokenizer(cfg: DataConfig) -> None:
    if cfg.tokenizer not in ("byte", "bpe"):
        path = os.path.expanduser(cfg.tokenizer)
        if not (
            os.path.isfile(os.path.join(path, "tokenizer.json")) or path.endswith(".json") and os.path.isfile(path)
        ):
            raise DataError(
                f"data.tokenizer {cfg.tokenizer!r} is neither 'byte', 'bpe' nor a directory holding "
                "tokenizer.json; give one of those"
            )


def source_fingerprint(cfg: DataConfig) -> list:
    """What identifies the source's content cheaply: format, field and ``[path, size, mtime_ns]`` per file (a saved
    dataset's files and split); a mixture's is its sources' (with each one's ``max_bytes``)."""
    if cfg.sources:
        return [[c.max_bytes, source_fingerprint(c)] for c in cfg.per_source()]
    entries = []
    for f in resolve_files(cfg):
        st = os.stat(f)
        if os.path.isdir(f):
            entries.append([os.path.abspath(f), cfg.dataset_split, dataset_files(f)])
        else:
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
    fixed = pattern[: min(pattern.index(c) for c in "*?[" if c in pattern)]
    return os.path.abspath(fixed if fixed.endswith(os.sep) else os.path.dirname(fixed))


def path_label(cfg: DataConfig, root: str, path: str) -> str:
    """A file document's label by ``data.label_path``: ``package`` -- the first part of its path below ``root``
    (a top-level module's own name without ``.py``); ``directory`` -- its parent directory's name."""
    if cfg.label_path == "directory":
        return os.path.basename(os.path.dirname(os.path.abspath(path)))
    first = os.path.relpath(os.path.abspath(path), root).split(os.sep)[0]
    return first[:-3] if first.endswith(".py") else first


def labelled_documents(cfg: DataConfig, keep: set[str] | None = None) -> Iterator[tuple[str, int, str | None]]:
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
            fmt = file_format(cfg, path)
            if fmt in ("jsonl", *TABLES):
                read = _jsonl_documents if fmt == "jsonl" else functools.partial(table_documents, fmt=fmt)
                for text, n, label in read(cfg, path, left=left, keep=keep):
                    left = None if left is None else left - n
                    yield text, n, label
                continue
            label = path_label(cfg, root, path) if root is not None else None
            if keep is not None and label not in keep:
                continue
            with open(path, "rb") as f:
                raw = f.read() if left is None else f.read(left)
        except OSError as e:
            raise DataError(
                f"data.source: cannot read {path} ({e.strerror}); check the path and its permissions"
            ) from None
        if left is not None:
            left -= len(raw)
        if raw:
            text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=left is None or left > 0)
            yield text, len(raw), label


def _jsonl_documents(
    cfg: DataConfig, path: str, left: int | None, keep: set[str] | None = None
) -> Iterator[tuple[str, int, str | None]]:
    return within_budget(_jsonl_records(cfg, path), left, keep)


def _jsonl_records(cfg: DataConfig, path: str) -> Iterator[tuple[str, str | None]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e}); fix or remove that line") from None
            if not isinstance(record, dict) or not isinstance(record.get(cfg.text_field), str):
                raise DataError(
                    f"{path}:{lineno}: no string field {cfg.text_field!r}; fix the line or set data.text_field"
                )
            label = None
            if cfg.label_field is not None:
                if not isinstance(record.get(cfg.label_field), (str, int)):
                    raise DataError(
                        f"{path}:{lineno}: no label field {cfg.label_field!r}; fix the line or set data.label_field"
                    )
                label = str(record[cfg.label_field])
            yield record[cfg.text_field], label


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """The source's documents as strings, in order (what a BPE tokenizer trains on); a mixture's text sources' one
    after another."""
    for one in cfg.per_source():
        if not cfg.sources or resolve_format(one) != "tokens":
            for text, _, _ in labelled_documents(one):
                yield text
