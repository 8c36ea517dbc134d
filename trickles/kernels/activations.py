"""MLP activations: SwiGLU and GELU (tanh), the PyTorch references, the Triton kernels, their custom operators.

* SwiGLU (llama): ``h = silu(a) b`` with ``silu(a) = a sigma(a)``. Backward:
  ``da = dh b sigma(a) (1 + a (1 - sigma(a)))``, ``db = dh silu(a)``.
* GeGLU (Gemma, ``model.mlp_activation=gelu_tanh``): ``h = gelu_tanh(a) b``, the same kernels with the GELU below in
  place of silu (``GELU`` flag), saving the same ``a`` and ``b`` (:class:`GeGLUFunction` on the PyTorch path).
* GELU, tanh approximation (gpt2): ``h = a (1 + tanh(u)) / 2`` with ``u = sqrt(2/pi) (a + 0.044715 a^3)``.
  Backward: ``da = dh ((1 + tanh u) / 2 + a (1 - tanh^2 u) sqrt(2/pi) (1 + 3 0.044715 a^2) / 2)``.

One elementwise kernel each way (fp32 arithmetic, one rounding to the inputs' type); the SwiGLU kernels
also read a fused gate/up projection's output ``[..., f, 2]`` in place (``STRIDE = 2``: ``a`` and ``b`` are
neighbours, and their gradients are written as neighbours). The Triton SwiGLU saves only ``a`` and ``b`` (``2 p``
bytes per unit), and so does the PyTorch one (:class:`SwiGLUFunction`, recomputing ``silu(a)`` in backward;
autograd's own ``F.silu(a) * b`` would also keep ``silu(a)``: ``3 p``); GELU saves ``a`` as the eager one does. Each
is a custom operator pair (``trickles::swiglu``, ``swiglu_packed``, ``gelu_tanh`` and their ``_backward``), the
inputs saved by the registered autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import HAVE_TRITON, use_triton

BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tanh(u):
        return 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0

    @triton.jit
    def _gate(a, GELU: tl.constexpr):
        """The gate's activation of fp32 ``a`` and its derivative: silu, or with ``GELU`` GELU (tanh)."""
        if GELU:
            th = _tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
            act = 0.5 * a * (1.0 + th)
            grad = 0.5 * (1.0 + th) + 0.5 * a * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)
        else:
            sig = tl.sigmoid(a)
            act = a * sig
            grad = sig * (1.0 + a * (1.0 - sig))
        return act, grad

    @triton.jit
    def _swiglu_forward(A, B, H, n, STRIDE: tl.constexpr, GELU: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(A + offs * STRIDE, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs * STRIDE, mask=mask, other=0.0).to(tl.float32)
        act, _ = _gate(a, GELU)
        tl.store(H + offs, (act.to(A.dtype.element_ty).to(tl.float32) * b).to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward(DH, A, B, DA, DB, n, STRIDE: tl.constexpr, GELU: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(A + offs * STRIDE, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs * STRIDE, mask=mask, other=0.0).to(tl.float32)
        act, grad = _gate(a, GELU)
        tl.store(DA + offs * STRIDE, (dh * b * grad).to(DA.dtype.element_ty), mask=mask)
        tl.store(
            DB + offs * STRIDE, (dh * act.to(A.dtype.element_ty).to(tl.float32)).to(DB.dtype.element_ty), mask=mask
        )

    @triton.jit
    def _gelu_forward(A, H, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        tl.store(H + offs, (0.5 * a * (1.0 + _tanh(u))).to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_backward(DH, A, DA, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        th = _tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
        grad = 0.5 * (1.0 + th) + 0.5 * a * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)
        tl.store(DA + offs, (dh * grad).to(DA.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


def _out(like: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_like(like, dtype=dtype) if out is None else out


def swiglu_forward(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, gelu: bool = False):
    """The Triton forward on contiguous ``a``, ``b`` (into ``out`` if given, contiguous, of their shape); ``gelu``:
    GeGLU's ``gelu_tanh(a) * b``."""
    h = _out(a, out, torch.promote_types(a.dtype, b.dtype))
    _swiglu_forward[_grid(a.numel())](a, b, h, a.numel(), STRIDE=1, GELU=gelu, BLOCK=BLOCK)
    return h


def swiglu_backward(dh, a, b, da=None, db=None, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    da, db = _out(a, da), _out(b, db)
    _swiglu_backward[_grid(a.numel())](dh, a, b, da, db, a.numel(), STRIDE=1, GELU=gelu, BLOCK=BLOCK)
    return da, db


def swiglu_packed_forward(ab: torch.Tensor, out: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """The Triton forward on a contiguous packed ``ab [..., 2 f]`` (``a`` at even, ``b`` at odd positions)."""
    n = ab.numel() // 2
    h = torch.empty((*ab.shape[:-1], ab.shape[-1] // 2), dtype=ab.dtype, device=ab.device) if out is None else out
    flat = ab.view(-1)
    _swiglu_forward[_grid(n)](flat, flat[1:], h, n, STRIDE=2, GELU=gelu, BLOCK=BLOCK)
    return h


def swiglu_packed_backward(dh: torch.Tensor, ab: torch.Tensor, dab=None, gelu: bool = False) -> torch.Tensor:
    """The packed input's gradient ``[..., 2 f]`` (``da`` at even, ``db`` at odd positions), into ``dab`` if given."""
    n = ab.numel() // 2
    dab = _out(ab, dab)
    flat, dflat = ab.view(-1), dab.view(-1)
    _swiglu_backward[_grid(n)](dh, flat, flat[1:], dflat, dflat[1:], n, STRIDE=2, GELU=gelu, BLOCK=BLOCK)
    return dab


def gelu_forward(a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    h = _out(a, out)
    _gelu_forward[_grid(a.numel())](a, h, a.numel(), BLOCK=BLOCK)
    return h


def gelu_backward(dh: torch.Tensor, a: torch.Tensor, da: torch.Tensor | None = None) -> torch.Tensor:
    da = _out(a, da)
    _gelu_backward[_grid(a.numel())](dh, a, da, a.numel(), BLOCK=BLOCK)
    return da


@torch.library.custom_op("trickles::swiglu", mutates_args=())
def swiglu_op(a: torch.Tensor, b: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``silu(a) * b`` in Triton (``a``, ``b`` of one shape); ``gelu``: ``gelu_tanh(a) * b``."""
    return swiglu_forward(a.contiguous(), b.contiguous(), gelu=gelu)


@swiglu_op.register_fake
def _(a, b, gelu=False):
    return torch.empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)


@torch.library.custom_op("trickles::swiglu_backward", mutates_args=())
def swiglu_backward_op(
    dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, gelu: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_backward(dh.contiguous(), a.contiguous(), b.contiguous(), gelu=gelu)


@swiglu_backward_op.register_fake
def _(dh, a, b, gelu=False):
    return torch.empty(a.shape, dtype=a.dtype, device=a.device), torch.empty(b.shape, dtype=b.dtype, device=b.device)


@torch.library.custom_op("trickles::swiglu_packed", mutates_args=())
def swiglu_packed_op(ab: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``silu(a) * b`` (``gelu``: ``gelu_tanh(a) * b``) of a packed ``ab [..., 2 f]`` (``a`` at even, ``b`` at odd
    positions) in Triton."""
    return swiglu_packed_forward(ab.contiguous(), gelu=gelu)


@swiglu_packed_op.register_fake
def _(ab, gelu=False):
    return torch.empty((*ab.shape[:-1], ab.shape[-1] // 2), dtype=ab.dtype, device=ab.device)


@torch.library.custom_op("trickles::swiglu_packed_backward", mutates_args=())
def swiglu_packed_backward_op(dh: torch.Tensor, ab: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    return swiglu_packed_backward(dh.contiguous(), ab.contiguous(), gelu=gelu)


@torch.library.custom_op("trickles::gelu_tanh", mutates_args=())
def gelu_tanh_op(a: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) in Triton."""
    return gelu_forward(a.contiguous())


@torch.library.custom_op("trickles::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward_op(dh: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return gelu_backward(dh.contiguous(), a.contiguous())


gelu_tanh_op.register_fake(lambda a: torch.empty(a.shape, dtype=a.dtype, device=a.device))
swiglu_packed_backward_op.register_fake(
    lambda dh, ab, gelu=False: torch.empty(ab.shape, dtype=ab.dtype, device=ab.device)
)
gelu_tanh_backward_op.register_fake(lambda dh, a: torch.empty(a.shape, dtype=a.dtype, device=a.device))


def _save_inputs(ctx, inputs, output):
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    ctx.gelu = [bool(x) for x in inputs[len(tensors) :]]  # the gated kernels' flag (none for gelu_tanh)
    ctx.save_for_backward(*tensors)  # the pre-activations (a packed gate/up output as one tensor)


def _gated_backward(op, ctx, dh):
    grads = op(dh, *ctx.saved_tensors, *ctx.gelu)
    return (*grads, None) if isinstance(grads, tuple) else (grads, None)


swiglu_op.register_autograd(lambda ctx, dh: _gated_backward(swiglu_backward_op, ctx, dh), setup_context=_save_inputs)
swiglu_packed_op.register_autograd(
    lambda ctx, dh: _gated_backward(swiglu_packed_backward_op, ctx, dh), setup_context=_save_inputs
)
gelu_tanh_op.register_autograd(
    lambda ctx, dh: gelu_tanh_backward_op(dh, *ctx.saved_tensors), setup_context=_save_inputs
)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(a) * b`` in PyTorch operations saving only ``a`` and ``b``: the backward runs autograd's own kernels
    (``da = silu_backward(dh b, a)``, ``db = dh silu(a)`` with ``silu(a)`` recomputed), so the gradients are those of
    ``F.silu(a) * b`` bit for bit. Beside ``dh`` it allocates only the two gradients (``db`` in place of the
    recomputed ``silu(a)``, ``da`` in place of ``dh b``), as autograd's backward of ``F.silu(a) * b`` does."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        a, b = ctx.saved_tensors
        db = F.silu(a).mul_(dh)
        da = dh * b
        return torch.ops.aten.silu_backward.grad_input(da, a, grad_input=da), db


class GeGLUFunction(torch.autograd.Function):
    """``gelu_tanh(a) * b`` (GeGLU, Gemma) saving only ``a`` and ``b``, as :class:`SwiGLUFunction` does: ``da =
    gelu_backward(dh b, a)``, ``db = dh gelu_tanh(a)`` recomputed, the gradients of ``F.gelu(a, approximate="tanh") *
    b`` bit for bit."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.gelu(a, approximate="tanh") * b

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        a, b = ctx.saved_tensors
        db = F.gelu(a, approximate="tanh").mul_(dh)
        da = dh * b
        return torch.ops.aten.gelu_backward.grad_input(da, a, approximate="tanh", grad_input=da), db


def geglu(a: torch.Tensor, b: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """``gelu_tanh(a) * b`` (GeGLU: the gated MLP's activation with ``model.mlp_activation=gelu_tanh``); the Triton
    path is the SwiGLU kernel's GELU variant (measured as ``swiglu``)."""
    if a.shape != b.shape:
        return F.gelu(a, approximate="tanh") * b
    return swiglu_op(a, b, True) if use_triton(kernels, a, "swiglu") else GeGLUFunction.apply(a, b)


def geglu_packed(ab: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """:func:`geglu` of a fused gate/up projection's output ``ab [..., 2 f]`` (as :func:`swiglu_packed` reads it)."""
    if use_triton(kernels, ab, "swiglu"):
        return swiglu_packed_op(ab, True)
    return GeGLUFunction.apply(*ab.unflatten(-1, (-1, 2)).unbind(-1))


def swiglu(a: torch.Tensor, b: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """``silu(a) * b`` (the gated MLP's activation)."""
    if a.shape != b.shape:
        return F.silu(a) * b
    return swiglu_op(a, b) if use_triton(kernels, a, "swiglu") else SwiGLUFunction.apply(a, b)


def swiglu_packed(ab: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """``silu(a) * b`` of a fused gate/up projection's output ``ab [..., 2 f]``, read as ``[..., f, 2]``
    (:mod:`trickles.models.fused`): ``a = ab[..., 0::2]``, ``b = ab[..., 1::2]``. The Triton kernel reads the
    pairs in place and writes their gradients into one packed buffer."""
    if use_triton(kernels, ab, "swiglu"):
        return swiglu_packed_op(ab)
    return SwiGLUFunction.apply(*ab.unflatten(-1, (-1, 2)).unbind(-1))


def gelu_tanh(a: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """GELU with the tanh approximation."""
    if use_triton(kernels, a, "gelu_tanh"):
        return gelu_tanh_op(a)
    return F.gelu(a, approximate="tanh")
