"""Inference: batched decoding of prompts of different lengths (:mod:`.decode`), beam search (:mod:`.beam`),
layer streaming for models larger than the device (:mod:`.streaming`, :mod:`.placement`) and an HTTP server with
OpenAI-style completions (:mod:`.server`, needs the ``serve`` extra)."""

from .beam import beam_search
from .decode import Completion, PaddedBatch, Sampling, decode
from .placement import Placement, plan_placement
from .streaming import load_streaming

__all__ = [
    "Completion",
    "PaddedBatch",
    "Placement",
    "Sampling",
    "beam_search",
    "decode",
    "load_streaming",
    "plan_placement",
]
