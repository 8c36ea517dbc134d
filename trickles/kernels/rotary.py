"""Rotary position embedding of queries and keys: the PyTorch reference, the Triton kernel, the autograd function.

With ``x [B, T, H, D]`` split into halves ``x1, x2`` along ``D`` and tables ``cos, sin [T, D]`` (halves
``c1, c2``, ``s1, s2``; the model's tables repeat each frequency in both halves), rotate-half:

    ``y1 = x1 c1 - x2 s1``,    ``y2 = x2 c2 + x1 s2``.

The map is linear and orthogonal per frequency, so backward applies its transpose to ``dy``:
``dx1 = dy1 c1 + dy2 s2``, ``dx2 = dy2 c2 - dy1 s1``.

The Triton kernel rotates queries and keys **in place** (one program per ``(b, t)`` row, all heads at
once, fp32 arithmetic and one rounding to ``x``'s type), and its backward rotates the incoming
gradients in place too: it saves nothing but views of the tables, which are model buffers. The
reference computes ``x cos + rotate_half(x) sin`` in ``x``'s type out of place and, in low precision,
keeps the tables cast to it for backward.
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate(X, COS, SIN, stride_b, stride_t, stride_h, T, H, HALF, TRANSPOSE: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // T
        t = pid % T
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < H) & (cols < HALF)
        c1 = tl.load(COS + t * 2 * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t * 2 * HALF + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t * 2 * HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t * 2 * HALF + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        base = X + b * stride_b + t * stride_t + heads * stride_h
        x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(base + cols, y1.to(X.dtype.element_ty), mask=mask)
        tl.store(base + HALF + cols, y2.to(X.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> None:
    b, t, h, d = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rotary kernel: the head dimension must be contiguous")
    _rotate[(b * t,)](x, cos, sin, x.stride(0), x.stride(1), x.stride(2), t, h, d // 2, TRANSPOSE=transpose,
                      BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d // 2))


class _Rotary(torch.autograd.Function):
    """Rotates ``x`` in place; backward rotates its gradient back in place. (One tensor per call: autograd
    cannot rebase two in-place views returned by one function, so queries and keys are two calls.)"""

    @staticmethod
    def forward(ctx, x, cos, sin):
        _launch(x, cos, sin, transpose=False)
        ctx.mark_dirty(x)
        ctx.tables = (cos, sin)  # views of the model's buffers, not activations
        return x

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.tables
        g = g.contiguous() if g.stride(-1) != 1 else g.clone()
        _launch(g, cos, sin, transpose=True)
        return g, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference: rotates ``x [B, T, H, D]`` by position, ``x*cos + rotate_half(x)*sin`` (``cos, sin: [T, D]``,
    or ``[B, T, D]`` for per-row positions)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "torch"):
    """Queries and keys ``[B, T, H, D]`` rotated by position (the Triton path overwrites them)."""
    if use_triton(kernels, q) and cos.dim() == 2:  # per-row tables [B, T, D] (padded batches): the reference
        cos, sin = cos.contiguous(), sin.contiguous()
        return _Rotary.apply(q, cos, sin), _Rotary.apply(k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
