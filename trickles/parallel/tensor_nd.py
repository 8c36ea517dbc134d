"""Multi-dimensional tensor parallelism (Colossal-AI's 2-D, Optimus): the layers.

1-D tensor parallelism (:mod:`trickles.parallel.tensor`) splits each matrix over ``tp`` ranks but keeps every
activation outside the matmuls whole (or, with sequence parallelism, sequence-sharded) and moves whole
activations in its all-reduces: a rank's bytes do not shrink as ``tp`` grows. The 2-D algorithm puts the
``tp = q^2`` ranks on a ``q x q`` grid (:class:`~trickles.topology.TPGrid`; rank ``(i, j)``: row ``i``, column
``j``) and splits activations *and* weights in ``q x q`` blocks.

:class:`Linear2D` ``Y = X A + b`` with ``X [N, h]`` (the tokens ``N`` flattened) and ``A [h, h']`` (PyTorch stores
``weight = A^T [h', h]``):

* rank ``(i, j)`` holds ``X_ij [N/q, h/q]`` (token block ``i``, hidden block ``j``), ``A_ij [h/q, h'/q]`` (input
  block ``i``, output block ``j``; ``weight`` block ``(j, i)`` of ``A^T``) and ``b_j [h'/q]`` (the same on every
  row of column ``j``);
* forward (SUMMA with all-gathers): ``X_i = [X_i0 .. X_i,q-1]`` gathered along the row (``tp_row``),
  ``A_j = [A_0j; ..; A_q-1,j]`` gathered along the column (``tp_col``), ``Y_ij = X_i A_j + b_j`` -- the output
  ``[N/q, h'/q]`` is split exactly as the input, so 2-D layers chain without any other communication;
* backward: ``dX_i = dY_ij A_j^T [N/q, h]`` reduce-scattered along the row gives ``dX_ij`` (the sum over ``j`` of
  every column's contribution); ``dA_j = X_i^T dY_ij [h, h'/q]`` reduce-scattered along the column gives ``dA_ij``
  (the sum over the row blocks ``i`` of the tokens); ``db_j`` is ``dY_ij`` summed over the tokens, all-reduced
  along the column (every row holds the same bias);
* bytes each rank sends (ring algorithms, ``p`` bytes per element): forward ``(q-1) p (N h + h h') / q^2`` (the
  two all-gathers), backward the same in the two reduce-scatters, plus ``2 (q-1)/q p h'/q`` for the bias. 1-D at
  the same ``tp`` moves ``2 (tp-1)/tp p N h'`` per all-reduce: a whole activation.

The gathered ``X_i`` and ``A_j`` are kept for backward (``q`` times the local blocks: no second gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import GroupComm


class _Summa(torch.autograd.Function):
    """``Y_ij = X_i A_j (+ b_j)``, see the module docstring; ``weight`` is this rank's block of ``A^T``."""

    @staticmethod
    def forward(ctx, x, weight, bias, row: GroupComm, col: GroupComm):
        x_row = row.all_gather(x, dim=-1)  # [..., h]
        w_col = col.all_gather(weight, dim=1)  # [h'/q, h]: A_j^T
        ctx.save_for_backward(x_row, w_col)
        ctx.row, ctx.col, ctx.has_bias = row, col, bias is not None
        return F.linear(x_row, w_col, bias)

    @staticmethod
    def backward(ctx, dy):
        x_row, w_col = ctx.saved_tensors
        row, col = ctx.row, ctx.col
        dx = row.reduce_scatter(dy @ w_col, dim=-1)
        dw = col.reduce_scatter(dy.reshape(-1, dy.shape[-1]).t() @ x_row.reshape(-1, x_row.shape[-1]), dim=1)
        db = col.all_reduce(dy.reshape(-1, dy.shape[-1]).sum(0)) if ctx.has_bias else None
        return dx, dw, db, None, None


class Linear2D(nn.Module):
    """``y = x A + b`` on a ``q x q`` grid (module docstring): ``x`` is this rank's ``[..., h/q]`` block of the tokens of
    its row, ``weight`` its ``[h'/q, h/q]`` block (``tp_spec``: global shape and offset, as every tensor-parallel
    parameter), ``bias`` its column's ``[h'/q]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, row: GroupComm, col: GroupComm, device=None):
        super().__init__()
        from .tensor import TPSpec, set_spec

        q = row.size
        if col.size != q:
            raise ValueError(f"a 2-D grid is square: rows of {row.size} ranks, columns of {col.size}")
        for name, n in (("input", in_features), ("output", out_features)):
            if n % q:
                raise ValueError(f"2-D tensor parallelism splits the {name} width ({n}) into q = {q} blocks; "
                                 f"make it a multiple of {q}")
        self.row, self.col, self.q = row, col, q
        self.in_features, self.out_features = in_features, out_features
        i, j = col.rank, row.rank  # the column group's rank is the row index, and the other way round
        self.weight = nn.Parameter(torch.empty(out_features // q, in_features // q, device=device))
        set_spec(self.weight, TPSpec((out_features, in_features), (j * out_features // q, i * in_features // q)))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // q, device=device))
            # every row holds the same bias block: its gradient is summed along the column inside backward
            set_spec(self.bias, TPSpec((out_features,), (j * out_features // q,), replicated=False))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Summa.apply(x, self.weight, self.bias, self.row, self.col)

    def wire_bytes(self, tokens: int, element_bytes: int) -> dict[str, float]:
        """What one forward and one backward send per rank for ``tokens`` rows of this rank's block row (module docstring)."""
        q, h, h2, p = self.q, self.in_features, self.out_features, element_bytes
        gathers = (q - 1) * p * (tokens * h // q + h * h2 // (q * q))
        bias = 2 * (q - 1) / q * p * (h2 // q) if self.bias is not None else 0.0
        return {"forward": float(gathers), "backward": float(gathers + bias)}


def split_2d(full: torch.Tensor, i: int, j: int, q: int) -> torch.Tensor:
    """Block ``(i, j)`` of the last two dimensions' ``q x q`` split of ``full`` (tests and initialization)."""
    rows, cols = full.shape[-2] // q, full.shape[-1] // q
    return full[..., i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]


__all__ = ["Linear2D", "split_2d"]
