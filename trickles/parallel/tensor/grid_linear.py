"""Multi-dimensional tensor parallelism (Colossal-AI's 2-D, Optimus): the layers.

1-D tensor parallelism (:mod:`trickles.parallel.tensor.layers`) splits each matrix over ``tp`` ranks but keeps every
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

The gathered ``X_i`` and ``A_j`` are kept for backward (``q`` times the local blocks: no second gather). The
collectives do not wait for each other where nothing needs them: a forward's two all-gathers are in flight together,
and in backward ``dX``'s reduce-scatter runs while ``dA`` is computed (the same for :class:`Linear3D`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import GroupComm


def _gather(comm: GroupComm, t: torch.Tensor, dim: int):
    """Starts the all-gather of ``t`` along ``dim`` over ``comm``; returns the function that waits for it and returns
    the gathered tensor (the collective gathers whole blocks along a new leading dimension, laid side by side after)."""
    handle = comm.all_gather(t.contiguous().unsqueeze(0), dim=0, async_op=True)
    return lambda: torch.cat(handle.wait().unbind(0), dim=dim)


class _Summa(torch.autograd.Function):
    """``Y_ij = X_i A_j (+ b_j)``, see the module docstring; ``weight`` is this rank's block of ``A^T``. ``dep``: the
    2.5-D depth group, whose layers hold the same weight blocks for other tokens (their gradients are summed)."""

    @staticmethod
    def forward(ctx, x, weight, bias, row: GroupComm, col: GroupComm, dep: GroupComm | None):
        gathering = _gather(row, x, -1)  # both gathers in flight together
        w_col = _gather(col, weight, 1)()  # [h'/q, h]: A_j^T
        x_row = gathering()  # [..., h]
        ctx.save_for_backward(x_row, w_col)
        ctx.comms, ctx.has_bias = (row, col, dep), bias is not None
        return F.linear(x_row, w_col, bias)

    @staticmethod
    def backward(ctx, dy):
        x_row, w_col = ctx.saved_tensors
        row, col, dep = ctx.comms
        dy = dy.contiguous()
        # dX's reduce-scatter runs while dA is computed
        dx = row.reduce_scatter((dy @ w_col.to(dy.dtype)).to(x_row.dtype), dim=x_row.dim() - 1, async_op=True)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = col.reduce_scatter(
            (dy2.t() @ x_row.reshape(-1, x_row.shape[-1]).to(dy.dtype)).to(w_col.dtype), dim=1, async_op=True
        )
        db = col.all_reduce(dy2.sum(0).to(w_col.dtype)) if ctx.has_bias else None
        dx, dw = dx.wait(), dw.wait()
        if dep is not None:
            dep.all_reduce(dw)
            if db is not None:
                dep.all_reduce(db)
        return dx, dw, db, None, None, None


class Linear2D(nn.Module):
    """``y = x A + b`` on a ``q x q`` grid (module docstring): ``x`` is this rank's ``[..., h/q]`` block of the tokens
    of its row, ``weight`` its ``[h'/q, h/q]`` block (``tp_spec``: global shape and offset, as every tensor-parallel
    parameter), ``bias`` its column's ``[h'/q]``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        row: GroupComm,
        col: GroupComm,
        device=None,
        dep: GroupComm | None = None,
    ):
        super().__init__()
        from .layers import TPSpec, set_spec

        q = row.size
        if col.size != q:
            raise ValueError(f"a 2-D grid is square: rows of {row.size} ranks, columns of {col.size}")
        for name, n in (("input", in_features), ("output", out_features)):
            if n % q:
                raise ValueError(
                    f"2-D tensor parallelism splits the {name} width ({n}) into q = {q} blocks; "
                    f"make it a multiple of {q}"
                )
        self.row, self.col, self.dep, self.q = row, col, dep, q
        self.in_features, self.out_features = in_features, out_features
        i, j = col.rank, row.rank  # the column group's rank is the row index, and the other way round
        top = dep is None or dep.rank == 0  # 2.5-D: the d layers hold the same blocks; the first counts and writes them
        self.weight = nn.Parameter(torch.empty(out_features // q, in_features // q, device=device))
        set_spec(
            self.weight, TPSpec((out_features, in_features), (j * out_features // q, i * in_features // q), primary=top)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // q, device=device))
            # every row holds the same bias block: its gradient is summed along the column inside backward
            set_spec(self.bias, TPSpec((out_features,), (j * out_features // q,), primary=top and i == 0))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Summa.apply(x, self.weight, self.bias, self.row, self.col, self.dep)

    def wire_bytes(self, tokens: int, element_bytes: int) -> dict[str, float]:
        """What one forward and one backward send per rank for ``tokens`` rows of this rank's block row (module
        docstring; 2.5-D adds the all-reduce of the weight and bias gradients over the ``d`` layers):
        :func:`summa_bytes`."""
        d = self.dep.size if self.dep is not None else 1
        return summa_bytes(self.q, d, tokens, self.in_features, self.out_features, self.bias is not None, element_bytes)


class Linear2p5D(Linear2D):
    """2.5-D (Tesseract): ``d`` stacked ``q x q`` grids (``tp = q^2 d``). Layer ``k`` runs the 2-D algorithm on its own
    ``1/d`` of the tokens (token block ``k q + i`` on row ``i`` of layer ``k``), every layer holding the same weight
    blocks; after backward the weight (and bias) gradients are all-reduced over the depth line (``tp_dep``):
    ``2 (d-1)/d p (h h'/q^2 + h'/q)`` more bytes per rank. Activations per rank shrink by ``q^2 d``, weights by
    ``q^2``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        row: GroupComm,
        col: GroupComm,
        dep: GroupComm,
        device=None,
    ):
        super().__init__(in_features, out_features, bias, row, col, device=device, dep=dep)


class _Cube(torch.autograd.Function):
    """``Y = X A`` on a ``q x q x q`` cube, see :class:`Linear3D` (``a``: the tokens' sub-split in, the output features'
    split out; ``b``: the input features' split in, the tokens' sub-split out; ``c``: the weight's sub-split)."""

    @staticmethod
    def forward(ctx, x, weight, bias, a: GroupComm, b: GroupComm, c: GroupComm):
        gathering = a.all_gather(x.contiguous(), dim=0, async_op=True)  # both gathers in flight together
        w_kj = _gather(c, weight, 1)()  # [h'/q, h/q]
        x_ik = gathering.wait()  # [N/q, h/q]: the whole token block of this rank's line
        ctx.save_for_backward(x_ik, w_kj)
        ctx.comms, ctx.has_bias = (a, b, c), bias is not None
        y = b.reduce_scatter(F.linear(x_ik, w_kj), dim=0)  # the partial products summed over the input blocks
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x_ik, w_kj = ctx.saved_tensors
        a, b, c = ctx.comms
        dp = b.all_gather(dy.contiguous(), dim=0)
        dx = a.reduce_scatter((dp @ w_kj.to(dp.dtype)).to(x_ik.dtype), dim=0, async_op=True)  # in flight during dA
        dp2 = dp.reshape(-1, dp.shape[-1])
        dw = c.reduce_scatter(
            (dp2.t() @ x_ik.reshape(-1, x_ik.shape[-1]).to(dp.dtype)).to(w_kj.dtype), dim=1, async_op=True
        )
        db = b.all_reduce(c.all_reduce(dy.reshape(-1, dy.shape[-1]).sum(0).to(w_kj.dtype))) if ctx.has_bias else None
        dx, dw = dx.wait(), dw.wait()
        return dx, dw, db, None, None, None


class Linear3D(nn.Module):
    """``y = x A + b`` on a ``q x q x q`` cube (3-D tensor parallelism, Agarwal et al.'s matmul as Colossal-AI runs it).

    Three groups of the cube (``tp_row``, ``tp_col``, ``tp_dep``, see :class:`~trickles.topology.TPGrid`) play three
    roles, ``a``, ``b`` and ``c`` (always the columns), and a rank's index in each is ``u``, ``v``, ``w``. With the
    tokens ``N`` in ``q`` blocks of ``q`` sub-blocks, and the input features in ``q`` blocks of ``q`` sub-blocks, a
    rank holds

    * ``X``: token block ``w``, its sub-block ``u``, input-feature block ``v``: ``[N/q^2, h/q]``;
    * ``A``: input-feature block ``v``, its sub-block ``w``, output-feature block ``u``: ``weight`` ``[h'/q, h/q^2]``;
    * ``Y``: token block ``w``, its sub-block ``v``, output-feature block ``u``: ``[N/q^2, h'/q]``.

    Forward: ``X_wv`` all-gathered over ``a`` (the token block), ``A_vu`` over ``c`` (the input block), the product
    ``X_wv A_vu`` reduce-scattered over ``b`` (summing the ``q`` input blocks, splitting the tokens again). Backward:
    ``dY`` all-gathered over ``b``; ``dX`` reduce-scattered over ``a``, ``dA`` over ``c``; ``db`` all-reduced over
    ``c`` and ``b``. The output's token sub-split is over ``b`` and its features over ``a``: the next layer takes the
    two roles swapped (``orientation``), so layers chain without other communication.

    Bytes per rank with ``p`` bytes per element, ``x = N h/q^3``, ``w = h h'/q^3``, ``y = N h'/q^3``: forward
    ``(q-1) p (x + w + y)``; backward the same (``dY``'s gather, ``dX``'s and ``dA``'s reduce-scatters), plus
    ``4 (q-1)/q p h'/q`` for a bias.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        row: GroupComm,
        col: GroupComm,
        dep: GroupComm,
        orientation: int = 0,
        device=None,
    ):
        super().__init__()
        from .layers import TPSpec, set_spec

        q = row.size
        if not (col.size == dep.size == q):
            raise ValueError(f"a 3-D grid is a cube: lines of {row.size}, {col.size} and {dep.size} ranks")
        if in_features % (q * q) or out_features % q:
            raise ValueError(
                f"3-D tensor parallelism splits the input width ({in_features}) into q^2 = {q * q} blocks and "
                f"the output width ({out_features}) into q = {q}; make them multiples"
            )
        a, b = (row, dep) if orientation == 0 else (dep, row)
        self.a, self.b, self.c, self.q = a, b, col, q
        self.in_features, self.out_features, self.orientation = in_features, out_features, orientation
        u, v, w = a.rank, b.rank, col.rank
        self.weight = nn.Parameter(torch.empty(out_features // q, in_features // (q * q), device=device))
        set_spec(
            self.weight,
            TPSpec(
                (out_features, in_features), (u * out_features // q, v * in_features // q + w * in_features // (q * q))
            ),
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // q, device=device))
            # held alike by the q^2 ranks of one a-index: the gradient is all-reduced over b and c in backward
            set_spec(self.bias, TPSpec((out_features,), (u * out_features // q,), primary=v == 0 and w == 0))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Cube.apply(x, self.weight, self.bias, self.a, self.b, self.c)

    def wire_bytes(self, tokens: int, element_bytes: int) -> dict[str, float]:
        """What one forward and one backward send per rank for all ``tokens`` ``N`` of the group (class docstring):
        :func:`cube_bytes`."""
        return cube_bytes(self.q, tokens, self.in_features, self.out_features, self.bias is not None, element_bytes)


def summa_bytes(q: int, d: int, tokens: int, h: int, h2: int, bias: bool, p: int) -> dict[str, float]:
    """Bytes one rank sends in a 2-D (``d = 1``) or 2.5-D :class:`Linear2D` ``h -> h'`` whose block row holds ``tokens``
    rows (``N / q`` for 2-D, ``N / (q d)`` for 2.5-D), ``p`` bytes per element: forward the two all-gathers
    ``(q-1) p (tokens h / q + h h' / q^2)``; backward the two reduce-scatters (the same), the bias all-reduce along
    the column ``2 (q-1)/q p h'/q`` and, for 2.5-D, the depth all-reduce ``2 (d-1)/d p (h h'/q^2 + h'/q)``."""
    gathers = (q - 1) * p * (tokens * h // q + h * h2 // (q * q))
    col_bias = 2 * (q - 1) / q * p * (h2 // q) if bias else 0.0
    depth = 2 * (d - 1) / d * p * (h * h2 // (q * q) + (h2 // q if bias else 0))
    return {"forward": float(gathers), "backward": float(gathers + col_bias + depth)}


def cube_bytes(q: int, tokens: int, h: int, h2: int, bias: bool, p: int) -> dict[str, float]:
    """Bytes one rank sends in a :class:`Linear3D` ``h -> h'`` over all ``tokens`` ``N`` of the cube: forward
    ``(q-1) p (N h + h h' + N h') / q^3``; backward the same, plus ``4 (q-1)/q p h'/q`` for a bias."""
    blocks = (q - 1) * p * (tokens * h + h * h2 + tokens * h2) // q**3
    bias_bytes = 4 * (q - 1) / q * p * (h2 // q) if bias else 0.0
    return {"forward": float(blocks), "backward": float(blocks + bias_bytes)}


def split_2d(full: torch.Tensor, i: int, j: int, q: int) -> torch.Tensor:
    """Block ``(i, j)`` of the last two dimensions' ``q x q`` split of ``full`` (tests and initialization)."""
    rows, cols = full.shape[-2] // q, full.shape[-1] // q
    return full[..., i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]


__all__ = ["Linear2D", "Linear2p5D", "Linear3D", "cube_bytes", "split_2d", "summa_bytes"]
