"""Rotary position embedding of queries and keys: the PyTorch reference, the Triton kernel, the custom operator.

With ``x [B, T, H, D]`` split into halves ``x1, x2`` along ``D`` and tables ``cos, sin [T, D]`` (halves
``c1, c2``, ``s1, s2``; the model's tables repeat each frequency in both halves), rotate-half:

    ``y1 = x1 c1 - x2 s1``,    ``y2 = x2 c2 + x1 s2``.

The map is linear and orthogonal per frequency, so backward applies its transpose to ``dy``:
``dx1 = dy1 c1 + dy2 s2``, ``dx2 = dy2 c2 - dy1 s1``.

The Triton kernel runs one program per ``(b, t)`` row (the position's table entries loaded once,
then all heads of the row), in fp32 with one rounding to the inputs' type, into new tensors; one
operator rotates queries and keys (a launch each): ``trickles::rotary`` returns fresh outputs and
``trickles::rotary_backward`` (the same kernel, transposed) fresh input gradients, so no operator
writes into its inputs and ``torch.compile`` / AOTAutograd see a pure function. It saves nothing for
backward but the tables (views of the model's buffers). Per-row tables ``[B, T, D]`` (left-padded
decoding) are read with their batch stride. The reference computes ``x cos + rotate_half(x) sin`` in
``x``'s type and, in low precision, keeps the tables cast to it for backward.
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate(
        X,
        Y,
        COS,
        SIN,
        table_stride_b,
        stride_b,
        stride_t,
        stride_h,
        T,
        H,
        HALF,
        TRANSPOSE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Rotates the ``H`` heads of row ``(b, t)`` of ``X`` (strided) into ``Y`` (contiguous ``[B, T, H, D]``)."""
        pid = tl.program_id(0)
        b = pid // T
        t = pid % T
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        inside = cols < HALF
        mask = (heads < H) & inside
        row = b * table_stride_b + t * 2 * HALF
        c1 = tl.load(COS + row + cols, mask=inside, other=0.0).to(tl.float32)
        c2 = tl.load(COS + row + HALF + cols, mask=inside, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + row + cols, mask=inside, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + row + HALF + cols, mask=inside, other=0.0).to(tl.float32)
        src = X + b * stride_b + t * stride_t + heads * stride_h
        x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        dst = Y + (pid * H + heads) * 2 * HALF
        tl.store(dst + cols, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + cols, y2.to(Y.dtype.element_ty), mask=mask)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rotate_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, T, Hq, D]`` and ``k [B, T, Hk, D]`` (any strides but the last) rotated into new contiguous tensors."""
    cos, sin = cos.contiguous(), sin.contiguous()
    table_stride_b = q.shape[1] * q.shape[3] if cos.dim() == 3 else 0
    out = []
    for x in (_unit_last(q), _unit_last(k)):
        b, t, h, d = x.shape
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _rotate[(b * t,)](
            x,
            y,
            cos,
            sin,
            table_stride_b,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            t,
            h,
            d // 2,
            TRANSPOSE=transpose,
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_D=triton.next_power_of_2(d // 2),
        )
        out.append(y)
    return out[0], out[1]


@torch.library.custom_op("trickles::rotary", mutates_args=())
def rotary_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys rotated by position in Triton (module docstring), new tensors."""
    return _rotate_pair(q, k, cos, sin, transpose=False)


@torch.library.custom_op("trickles::rotary_backward", mutates_args=())
def rotary_backward_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of queries and keys: the incoming ones rotated back (the transpose rotation)."""
    return _rotate_pair(dq, dk, cos, sin, transpose=True)


def _fake(q, k, cos, sin):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


rotary_op.register_fake(_fake)
rotary_backward_op.register_fake(_fake)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])  # the tables: views of the model's buffers, not activations


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = rotary_backward_op(dq, dk, cos, sin)
    return dq_in, dk_in, None, None


rotary_op.register_autograd(_backward, setup_context=_setup)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference: rotates ``x [B, T, H, D]`` by position, ``x*cos + rotate_half(x)*sin`` (``cos, sin: [T, D]``,
    or ``[B, T, D]`` for per-row positions)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "torch"):
    """Queries and keys ``[B, T, H, D]`` rotated by position (tables ``[T, D]``, or ``[B, T, D]`` per row)."""
    if use_triton(kernels, q, "rotary"):
        return rotary_op(q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
