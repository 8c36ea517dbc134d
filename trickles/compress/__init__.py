"""Compression: int8 quantization after training (:mod:`.quantize`, :mod:`.checkpoint`), quantization-aware training
(:mod:`.qat`), structured pruning (:mod:`.prune`), distillation (:mod:`.distill`) and the side-by-side report
(:mod:`.report`). See docs/compression.md."""

from .checkpoint import float_model, load_checkpoint, quantize_checkpoint
from .qat import apply_qat, fake_quant_rows
from .quantize import Int8Linear, error_bound, quantize_model, quantize_tokens, quantize_weight, set_mode

__all__ = [
    "float_model",
    "load_checkpoint",
    "quantize_checkpoint",
    "apply_qat",
    "fake_quant_rows",
    "Int8Linear",
    "error_bound",
    "quantize_model",
    "quantize_tokens",
    "quantize_weight",
    "set_mode",
]
