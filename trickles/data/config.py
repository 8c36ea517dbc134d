"""The ``[data]`` section: where text comes from, how it is tokenized, how it is cut; ``[[data.sources]]``: a
weighted mixture of sources (:mod:`trickles.data.mixture`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..options import opt, section_from_dict


@dataclass
class SourceConfig:
    """One source of a mixture (a ``[[data.sources]]`` table); unset keys take the ``[data]`` section's value."""

    path: str = opt("", "the source: a file, a glob, a .jsonl/.parquet file, a datasets directory or a token file")
    weight: float = opt(1.0, "share of the samples drawn from this source (weights are normalised to sum to 1)")
    name: str | None = opt(None, "name in metrics.jsonl (none: the file's name without its extension)")
    format: Literal["auto", "text", "jsonl", "parquet", "datasets", "tokens", "chat"] | None = opt(
        None, "how to read path (none: data.format)"
    )
    text_field: str | None = opt(None, "JSONL field / parquet or datasets column holding the text (none: data's)")
    dataset_split: str | None = opt(None, "a saved DatasetDict: the split to read (none: data.dataset_split)")
    max_bytes: int | None = opt(None, "read at most this many bytes of this source's text (none: data.max_bytes)")
    messages_field: str | None = opt(None, "a chat source's field holding the messages (none: data.messages_field)")


@dataclass
class DataConfig:
    """Corpus, tokenizer and sequence length (the ``[data]`` section)."""

    source: str = opt(
        "stdlib",
        "'stdlib' (this Python's standard-library source code), a text file, a glob, a .jsonl file, or a token file "
        "(.bin/.npy)",
    )
    format: Literal["auto", "text", "jsonl", "parquet", "datasets", "tokens", "chat"] = opt(
        "auto",
        "how to read source (auto: by file extension: .jsonl -> jsonl, .parquet -> parquet, .bin/.npy -> tokens, a "
        "directory written by datasets' save_to_disk -> datasets, else text); chat: conversations or prompt/completion "
        "records of a .jsonl/.parquet file or datasets directory, rendered by the tokenizer's chat template, the loss "
        "on the assistant's tokens only, packed with document masks (docs/data.md)",
    )
    messages_field: str = opt("messages", "data.format=chat: the field holding a record's [{role, content}] list")
    prompt_field: str = opt("prompt", "data.format=chat: a prompt/completion record's prompt field")
    completion_field: str = opt("completion", "data.format=chat: a prompt/completion record's completion field")
    overlong: Literal["truncate", "drop"] = opt(
        "truncate",
        "data.format=chat: a conversation longer than data.seq_len is cut to its first seq_len tokens or left out "
        "(counted in the run's data line)",
    )
    text_field: str = opt(
        "text", "field holding the text in each JSONL record (the column of a parquet or datasets source)"
    )
    dataset_split: str = opt("train", "a saved DatasetDict (save_to_disk of several splits): the split to read")
    sources: list[SourceConfig] = opt(
        [],
        "a weighted mixture instead of data.source: [[data.sources]] tables (path, weight, name, format, text_field, "
        "dataset_split, max_bytes, messages_field), or on the command line PATH[:WEIGHT],... (docs/data.md)",
    )
    tokenizer: str = opt(
        "byte",
        "'byte' (no files needed), 'bpe' (trained here with the tokenizers library), or a Hugging Face tokenizer "
        "directory",
    )
    bpe_vocab_size: int = opt(4096, "vocabulary size of the locally trained BPE tokenizer")
    token_dtype: Literal["uint16", "uint32"] = opt("uint16", "element type of a raw .bin token file")
    seq_len: int = opt(256, "tokens per training sequence")
    document_mask: bool = opt(
        False,
        "attention never crosses an end-of-text token inside a sequence and positions restart at every document "
        "(docs/packed-documents.md); always on with chat data",
    )
    val_fraction: float = opt(0.01, "share of the corpus (taken from its end, whole documents) held out for validation")
    max_bytes: int | None = opt(None, "read at most this many bytes of text (none: everything)")
    label_field: str | None = opt(None, "hard-routed experts: the JSONL field holding each document's label")
    label_path: Literal["none", "package", "directory"] = opt(
        "none",
        "hard-routed experts, file sources: a document's label from its path: package (first path part below the "
        "source's root, e.g. the stdlib package; a top-level module's own name) or directory (its parent directory's "
        "name)",
    )
    cache_dir: str | None = opt(
        None, "where tokenized corpora and trained tokenizers are cached (none: ~/.cache/trickles)"
    )

    def __post_init__(self) -> None:
        self.sources = [_source(item, i) for i, item in enumerate(self.sources)]
        if self.format == "chat" or any(s.format == "chat" for s in self.sources):
            self.document_mask = True  # conversations are packed: none attends to another

    def validate(self) -> None:
        self.check_sources()
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len must be at least 1, got {self.seq_len}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.bpe_vocab_size < 259:
            raise ConfigError(
                f"data.bpe_vocab_size must be at least 259 (256 bytes + specials), got {self.bpe_vocab_size}"
            )
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ConfigError(f"data.max_bytes must be positive or none, got {self.max_bytes}")

    def check_sources(self) -> None:
        """The mixture's tables: each has a path and a positive weight, names are unique, one way of giving data."""
        if not self.sources:
            return
        if self.source != "stdlib":
            raise ConfigError(
                f"data.source ({self.source!r}) and [[data.sources]] both give the data; keep one of them"
            )
        if self.label_field is not None or self.label_path != "none":
            raise ConfigError(
                "hard-routed experts' labels (data.label_field, data.label_path) do not combine with [[data.sources]] "
                "yet; give one data.source"
            )
        for i, s in enumerate(self.sources, 1):
            if not s.path:
                raise ConfigError(f"data.sources[{i}] has no path; give each [[data.sources]] table a path")
            if not (math.isfinite(s.weight) and s.weight > 0):
                raise ConfigError(
                    f"data.sources[{i}] ({s.path}) has weight {s.weight}; weights must be positive numbers"
                )
            if s.max_bytes is not None and s.max_bytes < 1:
                raise ConfigError(f"data.sources[{i}].max_bytes must be positive or none, got {s.max_bytes}")
        names = [s.name for s in self.sources if s.name is not None]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"data.sources: the name(s) {', '.join(twice)} are given twice; give each a new name")

    def per_source(self) -> list[DataConfig]:
        """Each source's own ``[data]`` section (``source``, and the keys its table sets); ``[self]`` without a
        mixture."""
        if not self.sources:
            return [self]
        out = []
        for s in self.sources:
            keys = {k: getattr(s, k) for k in ("format", "text_field", "dataset_split", "max_bytes", "messages_field")}
            given = {k: v for k, v in keys.items() if v is not None}
            out.append(dataclasses.replace(self, source=s.path, sources=[], **given))
        return out


def _source(item, index: int) -> SourceConfig:
    """A ``[[data.sources]]`` table (or a command line's ``PATH[:WEIGHT]``) as a :class:`SourceConfig`."""
    key = f"data.sources[{index + 1}]"
    if isinstance(item, SourceConfig):
        return item
    if isinstance(item, dict):
        return section_from_dict(SourceConfig, item, key)
    if isinstance(item, str):
        path, _, weight = item.strip().rpartition(":")
        try:
            return SourceConfig(path=path, weight=float(weight)) if path else SourceConfig(path=item.strip())
        except ValueError:
            return SourceConfig(path=item.strip())
    raise ConfigError(f"{key} must be a table (path, weight, ...) or PATH[:WEIGHT], got {item!r}")
