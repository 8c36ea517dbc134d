"""Data: tokenizers, corpus sources with a tokenized cache, the deterministic sharded loader, and weighted mixtures of
sources."""

from .config import DataConfig, SourceConfig
from .corpus import Corpus, load_corpus
from .loader import ShardedBatches, require_boundaries
from .mixture import MixedBatches, Mixture, MixtureSampler, data_batches, load_data
from .sources import check_source, iter_documents
from .tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer, load_tokenizer, train_bpe

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "HFTokenizer",
    "MixedBatches",
    "Mixture",
    "MixtureSampler",
    "ShardedBatches",
    "SourceConfig",
    "Tokenizer",
    "build_tokenizer",
    "check_source",
    "data_batches",
    "iter_documents",
    "load_corpus",
    "load_data",
    "load_tokenizer",
    "require_boundaries",
    "train_bpe",
]
