"""Columnar sources: parquet files (read with ``pyarrow``) and directories written by ``datasets``' ``save_to_disk``
(read with ``datasets.load_from_disk``).

Both need the ``data`` extra (``pip install 'trickles[data]'``); without it, the first use says so in one line. A
record's text is the column ``data.text_field``; a row whose text is null is an error naming the file and the row, as a
JSONL line without the field is. A saved ``DatasetDict`` (several splits) is read at ``data.dataset_split``.

:func:`rows` gives the named columns of every row, in file order, so any record shape (a text column, a chat's
messages) reads the same way from JSONL, parquet or a saved dataset; :func:`check_table` checks, cheaply and before any
process starts, that the file opens and holds the columns.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from typing import Any

from ..errors import DataError
from .config import DataConfig

TABLES = ("parquet", "datasets")  # the formats read here
_ROWS = 4096  # rows read per batch
_EXTRA = "pip install 'trickles[data]'"


def is_saved_dataset(path: str) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "dataset_dict.json"))
        or os.path.isfile(os.path.join(path, "state.json"))
        and os.path.isfile(os.path.join(path, "dataset_info.json"))
    )


def _module(name: str, what: str):
    """``name`` imported, or a one-line DataError saying to install the ``data`` extra."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise DataError(f"reading {what} needs the {name.split('.')[0]} package; {_EXTRA}") from None


def _dataset(cfg: DataConfig, path: str):
    """The ``datasets.Dataset`` saved at ``path`` (a DatasetDict's ``data.dataset_split``)."""
    datasets = _module("datasets", f"{path} (a datasets directory)")
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # (datasets raises many kinds; each becomes one line here)
        raise DataError(f"{path}: datasets cannot load it ({type(e).__name__}: {e}); check the directory") from None
    if isinstance(ds, datasets.DatasetDict):
        if cfg.dataset_split not in ds:
            raise DataError(
                f"{path} holds the splits {', '.join(ds)}, not {cfg.dataset_split!r}; set data.dataset_split "
                f"(or the source's dataset_split) to one of them"
            )
        ds = ds[cfg.dataset_split]
    return ds


def _parquet(path: str):
    pq = _module("pyarrow.parquet", f"{path} (parquet)")
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # (pyarrow raises ArrowInvalid, OSError, ...)
        raise DataError(f"{path}: not a readable parquet file ({e}); check the file or data.format") from None


def columns_of(cfg: DataConfig, path: str, fmt: str) -> list[str]:
    """The column names of a parquet file or saved dataset."""
    if fmt == "parquet":
        return list(_parquet(path).schema_arrow.names)
    return list(_dataset(cfg, path).column_names)


def check_table(cfg: DataConfig, path: str, fmt: str, needed: list[str]) -> None:
    """DataError (one line) when ``path`` cannot be opened as ``fmt`` or lacks one of the columns ``needed``."""
    have = columns_of(cfg, path, fmt)
    missing = [c for c in needed if c not in have]
    if missing:
        raise DataError(
            f"{path} has no column {missing[0]!r} (its columns: {', '.join(have) or 'none'}); set data.text_field "
            f"(or the source's text_field) to the column holding the text"
        )


def rows(cfg: DataConfig, path: str, fmt: str, columns: list[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row number from 1, {column: value})`` for every row of a parquet file or saved dataset, in order."""
    check_table(cfg, path, fmt, columns)
    if fmt == "parquet":
        batches = (b.to_pydict() for b in _parquet(path).iter_batches(batch_size=_ROWS, columns=columns))
    else:
        batches = _dataset(cfg, path).select_columns(columns).iter(batch_size=_ROWS)
    n = 0
    for batch in batches:
        for values in zip(*(batch[c] for c in columns)):
            n += 1
            yield n, dict(zip(columns, values))


def table_documents(
    cfg: DataConfig, path: str, fmt: str, left: int | None, keep: set[str] | None = None
) -> Iterator[tuple[str, int, str | None]]:
    """``(text, bytes, label or None)`` per row with text, within ``left`` bytes (the last one cut), as
    :func:`trickles.data.sources.labelled_documents` reads a JSONL file; ``keep``: only rows with these labels."""
    return within_budget(_table_records(cfg, path, fmt), left, keep)


def _table_records(cfg: DataConfig, path: str, fmt: str) -> Iterator[tuple[str, str | None]]:
    columns = [cfg.text_field] + ([cfg.label_field] if cfg.label_field is not None else [])
    for n, row in rows(cfg, path, fmt, columns):
        text = row[cfg.text_field]
        if not isinstance(text, str):
            raise DataError(
                f"{path}: row {n} has {json.dumps(text)[:40]} in column {cfg.text_field!r}, not text; fix the row or "
                "set data.text_field"
            )
        label = None
        if cfg.label_field is not None:
            if not isinstance(row[cfg.label_field], (str, int)):
                raise DataError(f"{path}: row {n} has no label in column {cfg.label_field!r}; fix the row")
            label = str(row[cfg.label_field])
        yield text, label


def within_budget(
    records: Iterator[tuple[str, str | None]], left: int | None, keep: set[str] | None = None
) -> Iterator[tuple[str, int, str | None]]:
    """``(text, bytes, label)`` of each ``(text, label)`` record (a JSONL line's, a table row's) whose label ``keep``
    holds (None, or a record without a label: every one), within ``left`` bytes of UTF-8 (``data.max_bytes``: the
    last one cut at a character); empty texts are skipped."""
    for text, label in records:
        if keep is not None and label is not None and label not in keep:
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


def dataset_files(path: str) -> list[list]:
    """``[relative path, size, mtime_ns]`` of every file under a saved dataset (its content's fingerprint)."""
    out = []
    for here, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            st = os.stat(os.path.join(here, f))
            out.append([os.path.relpath(os.path.join(here, f), path), st.st_size, st.st_mtime_ns])
    return out
