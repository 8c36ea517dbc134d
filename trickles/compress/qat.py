"""Quantization-aware training: the projections compute with fake-quantized weights and inputs.

With ``train.qat`` every projection that :func:`~trickles.compress.quantize.quantize_model` would replace computes
``y = fq_x(x) fq_w(W)^T + b`` where ``fq`` rounds to the int8 grid and back (the float value int8 inference will
see): ``fq_w(W) = s_w round(W / s_w)`` with one scale ``s_w = max_k |W_jk| / 127`` per output row, and
``fq_x(x) = s_x round(x / s_x)`` with one scale per token, ``s_x = max_k |x_k| / 127``. Rounding has zero
gradient almost everywhere, so backward uses the **straight-through estimator**: ``d fq(v) / dv = 1``
(``fq(v) = v + (round-trip(v) - v).detach()``), the scales treated as constants. The int8 export of the trained
weights (:func:`~trickles.compress.checkpoint.quantize_checkpoint`) then holds exactly the codes training saw.

Under tensor parallelism (:mod:`trickles.parallel.tensor.layers`) the scales must be those of the whole tensors:

* column-parallel layers (and the replicated key/value projection) hold whole rows of ``W`` and see whole tokens
  ``x``: both scales are local;
* a row-parallel layer holds a block of every row's columns and a block of every token's features: both maxima
  (``[n]`` per row, ``[tokens]`` per token) are all-reduced with ``max`` over the tp group -- two small
  all-reduces per row-parallel layer per forward, counted in the ledger like every collective.

Data parallelism and ZeRO change nothing (every rank's layers hold whole rows locally, ZeRO-3 gathers them before
the forward); pipeline stages quantize the projections they hold. The layers keep their parameters and names, so
checkpoints, resuming and resharding are unchanged. Mixture-of-experts blocks stay float (as in the export). An
untied output head is fake-quantized too, so its loss is computed from its logits (``model.fused_loss`` is turned
off for the run: the fused chunked loss reads the float weight).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import GroupComm
from .quantize import QMAX, quantized_names, scale_of


def _round_trip(v: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``s round(v / s)`` with ``s = amax / 127`` per leading row (``amax [rows]``; zero -> scale 1)."""
    s = scale_of(amax).unsqueeze(-1)
    return torch.round(v / s).clamp_(-QMAX, QMAX) * s


def fake_quant_rows(v: torch.Tensor, comm: GroupComm | None = None) -> torch.Tensor:
    """Each row of ``v [..., k]`` on its symmetric int8 grid (max over ``comm`` when its ``k`` is split), gradient
    straight through."""
    with torch.no_grad():
        amax = v.detach().abs().amax(dim=-1)
        if comm is not None and comm.size > 1:
            amax = comm.all_reduce(amax.contiguous(), op="max")
        q = _round_trip(v.detach(), amax).to(v.dtype)
    return v + (q - v).detach()


def _linear(self, x):
    return F.linear(fake_quant_rows(x), fake_quant_rows(self.weight), self.bias)


def _column(self, x):
    return self.ctx.linear(fake_quant_rows(x), fake_quant_rows(self.weight), self.bias, self.regather)


def _row(self, x):
    comm = self.ctx.comm
    y = self.ctx.leave(F.linear(fake_quant_rows(x, comm), fake_quant_rows(self.weight, comm)))
    return y + self.bias if self.bias is not None else y


def _replicated_kv(self, x):
    kv = self.ctx.linear(fake_quant_rows(x), fake_quant_rows(self.weight), self.bias, self.regather)
    kv = kv.view(*kv.shape[:-1], -1, self.head_dim)[..., self._heads, :]
    return kv.reshape(*kv.shape[:-2], -1)


def apply_qat(model: nn.Module) -> list[str]:
    """Makes every quantizable projection of ``model`` (single-device or tensor-parallel) fake-quantize; returns their
    names."""
    from ..parallel.tensor.layers import ColumnParallelLinear, ReplicatedKV, RowParallelLinear

    forwards = {
        nn.Linear: _linear,
        ColumnParallelLinear: _column,
        RowParallelLinear: _row,
        ReplicatedKV: _replicated_kv,
    }
    names = quantized_names(model)
    if "output" in names and getattr(model, "loss", None) is not None:
        model.loss.fused = False  # the loss from the (fake-quantized) head's logits, not from its float weight
    for name in names:
        mod = model.get_submodule(name)
        fwd = forwards.get(type(mod))
        if fwd is None:
            raise TypeError(
                f"quantization-aware training does not know how to fake-quantize {name} ({type(mod).__name__})"
            )
        mod.forward = types.MethodType(fwd, mod)  # an instance attribute: hooks and the parameters stay as they are
        mod.qat = True
    return names
