"""Inference: batched decoding of prompts of different lengths (:mod:`.decode`), beam search (:mod:`.beam`)
and an HTTP server with OpenAI-style completions (:mod:`.server`, needs the ``serve`` extra)."""

from .beam import beam_search
from .decode import Completion, PaddedBatch, Sampling, decode

__all__ = ["Completion", "PaddedBatch", "Sampling", "beam_search", "decode"]
