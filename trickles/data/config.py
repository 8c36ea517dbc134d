"""The ``[data]`` section: where text comes from, how it is tokenized, how it is cut."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..options import opt


@dataclass
class DataConfig:
    """Corpus, tokenizer and sequence length (the ``[data]`` section)."""

    source: str = opt(
        "stdlib",
        "'stdlib' (this Python's standard-library source code), a text file, a glob, a .jsonl file, or a token file "
        "(.bin/.npy)",
    )
    format: Literal["auto", "text", "jsonl", "tokens"] = opt(
        "auto", "how to read source (auto: by file extension: .jsonl -> jsonl, .bin/.npy -> tokens, else text)"
    )
    text_field: str = opt("text", "field holding the text in each JSONL record")
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
        "(docs/packed-documents.md)",
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

    def validate(self) -> None:
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
