"""Fused kernels: each file holds the PyTorch reference, the Triton kernel and the autograd function.

=====================  =====================================================  ==============================
file                   what                                                   saved for backward (Triton)
=====================  =====================================================  ==============================
``norms.py``           RMSNorm, LayerNorm: one pass per row forward, one      the input and per-row 1/rms
                       backward pass giving the input and weight gradients    (LayerNorm: and the mean)
``rotary.py``          rotary embedding of queries and keys, in place         nothing (the tables are buffers)
``activations.py``     SwiGLU ``silu(a) * b`` and GELU (tanh), one kernel     the pre-activations
                       each way
``cross_entropy.py``   the output projection and cross-entropy chunk by       the input and weight gradients,
                       chunk, never holding the ``[tokens, vocab]`` logits    computed in forward
=====================  =====================================================  ==============================

``model.kernels`` chooses the implementation: ``torch`` (the references: eager PyTorch, what the
activation-memory formulas of :mod:`trickles.memory.activations` describe), ``triton`` (these kernels;
on a CPU only under Triton's interpreter, ``TRITON_INTERPRET=1`` set before Python starts) and ``auto``
(Triton on CUDA when it is installed, the references elsewhere). The fused cross-entropy has a chunked
PyTorch path as well (``model.fused_loss``), so its memory saving is available on any device.

The model picks an implementation per call from the setting and the tensor's device
(:func:`use_triton`); nothing here knows about parallelism -- the vocabulary-parallel loss passes its
group in (:mod:`trickles.kernels.cross_entropy`).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

try:  # Triton is optional: without it every kernel runs its PyTorch path
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

Kernels = Literal["auto", "triton", "torch"]


def interpreting() -> bool:
    """Whether Triton runs its interpreter (on the CPU) rather than compiling for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def runs_triton(kernels: str, device_type: str) -> bool:
    """Whether the setting ``kernels`` runs the Triton kernels on a device of type ``device_type``."""
    if kernels == "torch":
        return False
    if kernels == "auto":
        return HAVE_TRITON and device_type == "cuda"
    return True


def use_triton(kernels: str, x: torch.Tensor) -> bool:
    """Whether the Triton kernel runs on ``x`` under the setting ``kernels``."""
    return runs_triton(kernels, x.device.type)


def check_kernels(kernels: str, device: torch.device) -> None:
    """Raises ConfigError when ``kernels`` cannot run on ``device`` (before any process group exists). Whether Triton is
    installed at all, :meth:`ModelConfig.validate <trickles.models.config.ModelConfig.validate>` checks."""
    from ..errors import ConfigError

    if kernels != "triton":
        return
    if device.type != "cuda" and not interpreting():
        raise ConfigError(f"model.kernels=triton runs on a CUDA device, or on the {device.type} under Triton's interpreter "
                          f"(set TRITON_INTERPRET=1 before starting); use model.kernels=auto to run the PyTorch path here")


def row_programs(rows: int, device: torch.device) -> int:
    """How many programs share ``rows`` rows in a backward pass that also reduces over rows (a weight gradient):
    a few per streaming multiprocessor on a GPU, a handful under the interpreter."""
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))
