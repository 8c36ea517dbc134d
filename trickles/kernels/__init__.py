"""Fused kernels: each file holds the PyTorch reference, the Triton kernel and its custom operators.

=====================  =====================================================  ==============================
file                   what                                                   saved for backward (Triton)
=====================  =====================================================  ==============================
``norms.py``           RMSNorm, LayerNorm: one pass per row forward, one      the input and per-row 1/rms
                       backward pass giving the input and weight gradients    (LayerNorm: and the mean)
``rotary.py``          rotary embedding of queries and keys                   nothing (the tables are buffers)
``activations.py``     SwiGLU ``silu(a) * b`` and GELU (tanh), one kernel     the pre-activations
                       each way
``cross_entropy.py``   the output projection and cross-entropy chunk by       the input and weight gradients,
                       chunk, never holding the ``[tokens, vocab]`` logits;   computed in forward
                       one kernel per chunk for its loss and gradient
=====================  =====================================================  ==============================

Each kernel is a PyTorch **custom operator** (``torch.library.custom_op``, namespace ``trickles``), forward
and backward each one op with a fake (meta) implementation that gives the outputs' shapes, and the
autograd formula registered on the forward op (``register_autograd``: what the forward saves, and the
backward op it calls). ``torch.compile`` therefore
sees each kernel as one opaque node: Dynamo never traces into Triton (or its interpreter), AOTAutograd
sees no mutation (no op writes into its inputs), and the same graph runs on CUDA and on a CPU.
``torch.library.opcheck`` tests every registration (``tests/unit/test_kernel_ops.py``).

``model.kernels`` chooses the implementation: ``torch`` (the references: eager PyTorch, what the
activation-memory formulas of :mod:`trickles.memory.activations` describe, and what Inductor fuses by
itself inside a compiled block), ``triton`` (these kernels; on a CPU only under Triton's interpreter,
``TRITON_INTERPRET=1`` set before Python starts) and ``auto``, which chooses **per kernel** from
:data:`MEASURED`: a kernel runs in Triton only on CUDA, with Triton installed, and only where its last
measurement on a GPU (``benchmarks/kernels.py``, the table in ``docs/kernels.md``) was at most the time of
eager PyTorch and of ``torch.compile`` -- inside a compiled block at most ``torch.compile``'s, whose
fusion it would otherwise replace. A kernel without a measurement of its current version is not picked, so
while :data:`MEASURED` holds no row ``auto`` runs PyTorch everywhere and the kernels are opt-in
(``model.kernels=triton``). ``model.fused_proj`` left unset follows the same rule from
:data:`MEASURED_PROJECTIONS` (:func:`fused_proj_default`). The fused cross-entropy has a chunked PyTorch path as well
(``model.fused_loss``), so its memory saving is available on any device.

The model picks an implementation per call from the setting, the kernel and the tensor's device
(:func:`use_triton`); nothing here knows about parallelism -- the vocabulary-parallel loss passes its
group in, by name (:mod:`trickles.kernels.groups`, :mod:`trickles.kernels.cross_entropy`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

try:  # Triton is optional: without it every kernel runs its PyTorch path
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

Kernels = Literal["auto", "triton", "torch"]

#: The kernels, by the name :data:`MEASURED` and ``benchmarks/kernels.py`` use.
KERNEL_NAMES = ("rms_norm", "layer_norm", "rotary", "swiglu", "gelu_tanh", "cross_entropy")


def interpreting() -> bool:
    """Whether Triton runs its interpreter (on the CPU) rather than compiling for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Measured:
    """One kernel's forward + backward on a GPU, median milliseconds (``benchmarks/kernels.py --device cuda --dtype bf16
    --shape llama-1b``), each contestant measured in the same run."""

    triton_ms: float  # this kernel
    eager_ms: float  # the PyTorch reference, eager
    compiled_ms: float  # the reference under torch.compile
    liger_ms: float | None  # liger-kernel's (None: it has none)
    where: str  # the device, software and date of the run

    def wins(self, compiled: bool) -> bool:
        """Whether the kernel is at most as slow as what it replaces: eager PyTorch and ``torch.compile`` of it, or
        inside a compiled block ``torch.compile`` alone."""
        return self.triton_ms <= (self.compiled_ms if compiled else min(self.eager_ms, self.compiled_ms))


#: The kernels ``auto`` may run, by name, with their last GPU measurement (None: the current version has none).
#: The first GPU run (H200, torch 2.11, Triton 3.6) measured the kernels before they became custom operators:
#: none was at most both eager's and liger-kernel's time (the in-place rotary beat eager, 0.76x, not liger, 1.14x),
#: and each has changed since (out of place, launch settings, one kernel for a chunk's loss and gradient), so none is
#: measured here; ``benchmarks/gpu_check.py`` prints the rows to enter.
MEASURED: dict[str, Measured | None] = {name: None for name in KERNEL_NAMES}


@dataclass(frozen=True)
class MeasuredProjections:
    """A llama block's input projections on a GPU, forward + backward, median milliseconds
    (``benchmarks/projections.py --device cuda --dtype bf16 --preset llama-1b --tokens 8192``), fused q/k/v and
    gate/up (``model.fused_proj=true``) against the separate ones, measured in the same run."""

    fused_ms: float  # one q/k/v matmul, one gate/up matmul
    separate_ms: float  # q, k, v and gate, up each their own matmul
    where: str  # the device, software and date of the run

    def wins(self) -> bool:
        """Whether the fused projections are at most as slow as the separate ones."""
        return self.fused_ms <= self.separate_ms


#: What ``model.fused_proj`` left unset reads under ``auto`` (None: never measured on a GPU, so not fused by default).
MEASURED_PROJECTIONS: MeasuredProjections | None = None


def auto_triton_kernels() -> list[str]:
    """The kernels ``auto`` may run in Triton on CUDA (in or outside compiled blocks), from :data:`MEASURED`; empty
    while no row shows a kernel winning: then ``auto`` runs PyTorch everywhere."""
    return [name for name in KERNEL_NAMES if MEASURED[name] is not None and MEASURED[name].wins(True)]


def measured_markdown() -> str:
    """:data:`MEASURED` and :data:`MEASURED_PROJECTIONS` as the markdown tables ``docs/kernels.md`` holds, with the line
    that says what ``auto`` runs today (a test keeps page and tables equal)."""
    rows = [
        "| kernel | ours (Triton) ms | eager ms | torch.compile ms | liger-kernel ms | `auto` runs | measured on |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in KERNEL_NAMES:
        m = MEASURED[name]
        if m is None:
            rows.append(f"| {name} | - | - | - | - | PyTorch (not measured) | - |")
            continue
        liger = "-" if m.liger_ms is None else f"{m.liger_ms:.3f}"
        runs = "Triton" if m.wins(False) else "Triton in compiled blocks" if m.wins(True) else "PyTorch"
        rows.append(
            f"| {name} | {m.triton_ms:.3f} | {m.eager_ms:.3f} | {m.compiled_ms:.3f} | {liger} | {runs} | {m.where} |"
        )
    p = MEASURED_PROJECTIONS
    rows += ["", "| projections | fused ms | separate ms | `auto` fuses | measured on |", "|---|---|---|---|---|"]
    if p is None:
        rows.append("| q/k/v, gate/up | - | - | no (not measured) | - |")
    else:
        rows.append(
            f"| q/k/v, gate/up | {p.fused_ms:.3f} | {p.separate_ms:.3f} | {'yes' if p.wins() else 'no'} | {p.where} |"
        )
    winners = auto_triton_kernels()
    runs = (
        f"Triton for {', '.join(winners)} on CUDA (where the table says so), PyTorch for the rest and on every "
        "other device"
        if winners
        else "PyTorch for every kernel on every device (no kernel is measured to win)"
    )
    fuses = (
        "fuses the projections on CUDA" if p is not None and p.wins() else "keeps the projections separate everywhere"
    )
    rows += ["", f"Today `model.kernels=auto` runs {runs}; with it, `model.fused_proj` unset {fuses}."]
    return "\n".join(rows) + "\n"


def triton_allowed(kernels: str, device_type: str) -> bool:
    """Whether the setting ``kernels`` lets Triton kernels run on a device of type ``device_type`` at all."""
    if kernels == "torch":
        return False
    if kernels == "auto":
        return HAVE_TRITON and device_type == "cuda"
    return True


def runs_triton(kernels: str, device_type: str, kernel: str) -> bool:
    """Whether the setting ``kernels`` runs the Triton version of ``kernel`` (one of :data:`KERNEL_NAMES`) on a device
    of type ``device_type``: always for ``triton``, never for ``torch``, and for ``auto`` where :data:`MEASURED` shows
    it winning (inside a block ``torch.compile`` is tracing, against the compiled reference)."""
    if kernel not in MEASURED:
        raise KeyError(f"unknown kernel {kernel!r}; one of {', '.join(KERNEL_NAMES)}")
    if kernels != "auto":
        return triton_allowed(kernels, device_type)
    measured = MEASURED[kernel]
    return (
        triton_allowed(kernels, device_type) and measured is not None and measured.wins(torch.compiler.is_compiling())
    )


def fused_proj_default(kernels: str, device_type: str) -> bool:
    """``model.fused_proj`` left unset, as ``kernels`` treats a kernel: fused under ``triton`` (the fused path chosen
    outright), never under ``torch``, and under ``auto`` only on CUDA, with Triton, where :data:`MEASURED_PROJECTIONS`
    shows the fused projections winning -- not measured, not fused."""
    if kernels != "auto":
        return triton_allowed(kernels, device_type)
    p = MEASURED_PROJECTIONS
    return triton_allowed(kernels, device_type) and p is not None and p.wins()


def use_triton(kernels: str, x: torch.Tensor, kernel: str) -> bool:
    """Whether the Triton version of ``kernel`` runs on ``x`` under the setting ``kernels``."""
    return runs_triton(kernels, x.device.type, kernel)


def check_kernels(kernels: str, device: torch.device) -> None:
    """Raises ConfigError when ``kernels`` cannot run on ``device`` (before any process group exists). Whether Triton is
    installed at all, :meth:`ModelConfig.validate <trickles.models.config.ModelConfig.validate>` checks."""
    from ..errors import ConfigError

    if kernels != "triton":
        return
    if device.type != "cuda" and not interpreting():
        raise ConfigError(
            f"model.kernels=triton runs on a CUDA device, or on the {device.type} under Triton's interpreter "
            f"(set TRITON_INTERPRET=1 before starting); use model.kernels=auto to run the PyTorch path here"
        )


def warps(block: int) -> int:
    """Warps for a program that holds ``block`` elements of a row: 4 below 2,048, 8 below 8,192, then 16 (a thread
    holds at most 16-32 elements, so wide rows spread over more threads rather than spill registers; liger-kernel's
    rule too)."""
    return 4 if block < 2048 else 8 if block < 8192 else 16


def row_programs(rows: int, device: torch.device) -> int:
    """How many programs share ``rows`` rows in a backward pass that also reduces over rows (a weight gradient):
    a few per streaming multiprocessor on a GPU, a handful under the interpreter."""
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))
