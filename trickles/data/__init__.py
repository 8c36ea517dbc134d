"""Data: tokenizers, corpus sources with a tokenized cache, and the deterministic sharded loader."""

from .config import DataConfig
from .corpus import Corpus, load_corpus
from .loader import ShardedBatches, require_boundaries
from .sources import check_source, iter_documents
from .tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer, load_tokenizer, train_bpe

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "HFTokenizer",
    "ShardedBatches",
    "Tokenizer",
    "build_tokenizer",
    "check_source",
    "iter_documents",
    "load_corpus",
    "load_tokenizer",
    "require_boundaries",
    "train_bpe",
]
