"""RMSNorm and LayerNorm: the PyTorch references, the Triton kernels and their autograd functions.

Rows of ``x [..., H]`` are normalized independently, statistics in fp32.

* RMSNorm (llama): ``r = 1/sqrt(mean(x^2) + eps)``, ``n = x r`` rounded to ``x``'s type, ``y = w n``
  (the type ``w * n`` promotes to). Backward, with ``g = dy w``:
  ``dx = r (g - n mean(g n))``, ``dw = sum_rows dy n``.
* LayerNorm (gpt2): ``mu = mean(x)``, ``r = 1/sqrt(var(x) + eps)`` (biased variance), ``n = (x - mu) r``,
  ``y = w n + b``. Backward: ``dx = r (g - mean(g) - n mean(g n))``, ``dw = sum_rows dy n``,
  ``db = sum_rows dy``.

The Triton forward runs one program per row (the whole row in one block) and saves only ``x`` and
the per-row fp32 statistics (``r``; LayerNorm also ``mu``): ``p H + 4`` bytes per row (``+ 4``), where
the eager RMSNorm keeps an fp32 copy of ``x``, its 1/rms and the normalized row. The backward runs a
few programs per streaming multiprocessor, each over every ``P``-th row, each writing its partial
weight (and bias) gradient to one row of an fp32 ``[P, H]`` buffer that a final sum reduces.

Under autocast the Triton LayerNorm computes and returns fp32, as autocast does for ``layer_norm``
on CUDA; RMSNorm's output type follows its inputs as the reference's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import HAVE_TRITON, row_programs, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_weight(W, H, BLOCK: tl.constexpr):
        """The columns of a row, their mask and the (fp32) weight: every norm kernel's start."""
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        return cols, mask, tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _rms_forward(X, W, Y, RSTD, stride, H, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
        n = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * H + cols, (n * w).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_backward(DY, X, W, RSTD, DX, DW, stride, rows, H, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        cols, mask, w = _row_weight(W, H, BLOCK)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(pid, rows, step):
            x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            n = x * rstd
            g = dy * w
            dx = rstd * (g - n * (tl.sum(g * n, axis=0) / H))
            tl.store(DX + row * H + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * n.to(X.dtype.element_ty).to(tl.float32)
        tl.store(DW + pid * H + cols, dw, mask=mask)

    @triton.jit
    def _ln_forward(X, W, B, Y, MEAN, RSTD, stride, H, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / H
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / H + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * H + cols, (xc * rstd * w + b).to(Y.dtype.element_ty), mask=mask)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _ln_backward(DY, X, W, MEAN, RSTD, DX, DW, DB, stride, rows, H, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        cols, mask, w = _row_weight(W, H, BLOCK)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        db = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(pid, rows, step):
            x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            n = tl.where(mask, (x - mean) * rstd, 0.0)
            g = dy * w
            dx = rstd * (g - tl.sum(g, axis=0) / H - n * (tl.sum(g * n, axis=0) / H))
            tl.store(DX + row * H + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * n
            db += dy
        tl.store(DW + pid * H + cols, dw, mask=mask)
        tl.store(DB + pid * H + cols, db, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, H]`` with unit stride along ``H`` (a copy only when it is not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = _rows(x)
        rows, h = x2.shape
        y = torch.empty((rows, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(h)
        _rms_forward[(rows,)](x2, weight, y, rstd, x2.stride(0), h, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape[:-1] + (h,))

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        rows, h = x2.shape
        dy = dy.reshape(rows, h).contiguous()
        dx = torch.empty((rows, h), dtype=x2.dtype, device=x2.device)
        progs = row_programs(rows, x2.device)
        dw = torch.empty((progs, h), dtype=torch.float32, device=x2.device)
        _rms_backward[(progs,)](dy, x2, weight, rstd, dx, dw, x2.stride(0), rows, h, BLOCK=triton.next_power_of_2(h))
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = _rows(x)
        rows, h = x2.shape
        y = torch.empty((rows, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        _ln_forward[(rows,)](x2, weight, bias, y, mean, rstd, x2.stride(0), h, eps, BLOCK=triton.next_power_of_2(h))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape, ctx.bias_dtype = x.shape, bias.dtype
        return y.view(x.shape[:-1] + (h,))

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, h = x2.shape
        dy = dy.reshape(rows, h).contiguous()
        dx = torch.empty((rows, h), dtype=x2.dtype, device=x2.device)
        progs = row_programs(rows, x2.device)
        dw = torch.empty((progs, h), dtype=torch.float32, device=x2.device)
        db = torch.empty((progs, h), dtype=torch.float32, device=x2.device)
        _ln_backward[(progs,)](dy, x2, weight, mean, rstd, dx, dw, db, x2.stride(0), rows, h, BLOCK=triton.next_power_of_2(h))
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), db.sum(0).to(ctx.bias_dtype), None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x)`` in eager PyTorch, the statistics in fp32."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: str = "torch") -> torch.Tensor:
    """RMSNorm of ``x``'s last dimension (module docstring); ``kernels`` picks the implementation."""
    if use_triton(kernels, x):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, kernels: str = "torch") -> torch.Tensor:
    """LayerNorm of ``x``'s last dimension (module docstring); ``kernels`` picks the implementation."""
    if use_triton(kernels, x):
        if torch.is_autocast_enabled(x.device.type):  # as autocast runs layer_norm on CUDA: in fp32
            x, weight, bias = x.float(), weight.float(), bias.float()
        return _LayerNorm.apply(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, with the statistics in fp32."""

    def __init__(self, dim: int, eps: float, kernels: str = "torch"):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernels)


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension (``nn.LayerNorm``'s parameters)."""

    def __init__(self, dim: int, eps: float, kernels: str = "torch"):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.normalized_shape = (dim,)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.kernels)
