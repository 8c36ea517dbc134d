"""Multi-dimensional tensor parallelism: everything of the model besides the linears.

:class:`GridContext` says how the residual stream ``[B, T, d]`` of a micro-batch is split over the ``tp`` ranks
of a grid (:class:`~trickles.topology.TPGrid`); the linears of :mod:`trickles.parallel.tensor.grid_linear` then keep it
split that way, and the modules here do the rest.

* **The split.** Samples (rows of the micro-batch: whole sequences, so attention stays local) over the *token*
  groups, hidden features over the *hidden* group:

  =====  ==============================================  ==========================  ================
  mode   a rank's samples (of the micro-batch's ``B``)   its features (of ``d``)     needs
  =====  ==============================================  ==========================  ================
  2-D    block ``i`` of ``q`` (``tp_col`` rank ``i``)    block ``j`` (``tp_row``)    ``q | B``
  2.5-D  block ``k q + i`` of ``q d`` (depth ``k``)      block ``j`` (``tp_row``)    ``q d | B``
  3-D    block ``w q + u`` of ``q^2`` (col ``w``, row    block ``v`` (``tp_dep``)    ``q^2 | B``
         ``u``)
  =====  ==============================================  ==========================  ================

  Each rank holds ``B T d / tp`` of the residual stream (1-D: all of it; with sequence parallelism ``1/tp``).
  Every module receives the whole micro-batch's token ids and targets and keeps its rows.
* **Attention** is local: the query/key/value projections' outputs are split by features, i.e. by whole heads
  (``q | n_heads``, ``q | n_kv_heads``), and every rank holds whole sequences of its samples.
* :class:`GridNorm` (RMSNorm / LayerNorm over features split on the hidden group): the row statistics are
  all-reduced over it (``[N, 1]`` per statistic), forward (one for RMS, two for LayerNorm's mean and variance)
  and backward (one ``[N, 1]``, or ``[N, 2]`` for LayerNorm). Its weight block is held alike by the ranks of the
  token groups: their gradients are all-reduced over them in backward (``copy_to_region``).
* :class:`GridEmbedding`, by mode. 2-D/2.5-D: the table's ``[V/q, d/q]`` block ``(i, j)`` (vocabulary ``i``,
  features ``j``) is all-gathered along the column (``tp_col``) into ``[V, d/q]`` and looked up; backward
  reduce-scatters the table's gradient along the column (and all-reduces it over the depth). Tied to the output
  layer, whose weight block at ``(i, j)`` is ``(j, i)`` (:class:`~.grid_linear.Linear2D`), the rank first swaps
  its block with rank ``(j, i)`` (point to point, ``V d / q^2`` elements; the diagonal keeps its own), and swaps
  the gradient back. 3-D: the block is the output layer's (:class:`~.grid_linear.Linear3D`: vocabulary ``u``,
  features ``v``, their sub-block ``w``), all-gathered over the column into ``[V/q, d/q]``; the column's ``q``
  samples' ids are looked up in this vocabulary slice (zeros elsewhere) and reduce-scattered over the row: the
  sum over the vocabulary slices, each rank keeping its sub-block. Backward: all-gather of ``dY`` over the row,
  reduce-scatter of the table gradient over the column.
* :class:`GridLoss`: the output layer's logits are split by vocabulary over ``tp_row`` in every mode (2-D:
  block ``j``; 3-D: the output's features ``u``), so the vocabulary-parallel cross-entropy runs over the row;
  each rank sums its samples' token losses and divides by the micro-batch's token count (all-reduced over the
  logits' token groups), and the all-reduce of those partial sums over the token groups (identity backward)
  gives every rank the micro-batch's mean loss. 3-D's logits hold samples ``w q + v`` (the output layer's
  output split, :class:`~.grid_linear.Linear3D`): the loss keeps those targets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import GroupComm, copy_to_region, gather_sequence, reduce_from_region, reduce_scatter_sequence
from ...kernels.cross_entropy import IGNORE_INDEX, OutputLoss
from ...topology import TPGrid
from .grid_linear import Linear2D, Linear2p5D, Linear3D
from .layers import TPSpec, set_spec
from .loss import vocab_parallel_losses


class GridContext:
    """The groups of one tensor-parallel grid and how the activations are split over them (module docstring).

    ``hidden``: the group splitting the residual stream's features; ``tokens``: the groups splitting its samples;
    ``logit_tokens``: the groups splitting the output layer's samples; ``vocab``: the group splitting the logits'
    vocabulary (always ``tp_row``)."""

    sequence_parallel = False  # (the pipeline runner asks every tensor-parallel context)

    def __init__(self, grid: TPGrid, tp: GroupComm, row: GroupComm, col: GroupComm, dep: GroupComm | None):
        self.grid, self.tp, self.row, self.col, self.dep = grid, tp, row, col, dep
        self.comm = tp  # (the rank of the private random streams, :class:`~.tensor.ForkRNG`)
        q = self.q = grid.q
        self.vocab = row
        if grid.mode == "3d":
            self.hidden, self.tokens, self.logit_tokens = dep, [col, row], [col, dep]
            self.block, self.logit_block = col.rank * q + row.rank, col.rank * q + dep.rank
        else:
            self.hidden = row
            self.tokens = self.logit_tokens = [col] + ([dep] if dep is not None else [])
            self.block = self.logit_block = (dep.rank if dep is not None else 0) * q + col.rank
        self.parts = q * q if grid.mode == "3d" else q * grid.depth  # sample blocks of a micro-batch

    @property
    def first_of_tokens(self) -> bool:
        """Whether this rank is the first of the ranks holding its feature blocks alike (it counts and writes them)."""
        return all(g.rank == 0 for g in self.tokens)

    def rows(self, t: torch.Tensor, logits: bool = False) -> torch.Tensor:
        """This rank's samples of a whole micro-batch's ``[B, ...]`` ids or targets (``logits``: the output layer's)."""
        if t.shape[0] % self.parts:
            raise ValueError(
                f"{self.grid.mode} tensor parallelism splits each micro-batch's {t.shape[0]} samples into "
                f"{self.parts} blocks; make the micro-batch a multiple of {self.parts}"
            )
        return t.chunk(self.parts)[self.logit_block if logits else self.block]

    def activation_shape(self, b: int, t: int, d: int, decoding: bool = False) -> tuple[int, int, int]:
        """This rank's part of a ``[b, t, d]`` residual-stream activation (what pipeline stages send)."""
        return (b // self.parts, t, d // self.q)

    def begin_forward(self, seq_len: int, decoding: bool = False) -> None:
        if decoding:
            raise ValueError("decoding with a KV cache needs 1-D tensor parallelism (parallel.tp_mode=1d)")

    def end_forward(self) -> None:
        pass

    def linear(self, in_features: int, out_features: int, bias: bool, second: bool = False, device=None) -> nn.Module:
        """The mode's parallel linear; ``second``: the layer that reads another's output (3-D swaps the roles)."""
        if self.grid.mode == "3d":
            return Linear3D(
                in_features, out_features, bias, self.row, self.col, self.dep, orientation=int(second), device=device
            )
        if self.dep is not None:
            return Linear2p5D(in_features, out_features, bias, self.row, self.col, self.dep, device=device)
        return Linear2D(in_features, out_features, bias, self.row, self.col, device=device)

    def shared(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` as used by this rank's samples: identity forward; backward sums its gradient over the token groups."""
        for g in self.tokens:
            w = copy_to_region(w, g)
        return w

    def feature_spec(self, shape: tuple[int, ...], dim: int) -> TPSpec:
        """The spec of a parameter split along ``dim`` by the hidden group (features) and held alike over the tokens."""
        offset = [0] * len(shape)
        offset[dim] = self.hidden.rank * (shape[dim] // self.q)
        return TPSpec(tuple(shape), tuple(offset), primary=self.first_of_tokens)


def _split(n: int, q: int, what: str) -> int:
    if n % q:
        raise ValueError(
            f"multi-dimensional tensor parallelism splits {what} ({n}) into {q} blocks; make it a multiple of {q}"
        )
    return n // q


class _RMSNorm(torch.autograd.Function):
    """``y = x r w``, ``r = (mean_d x^2 + eps)^-1/2`` with the sum over the features all-reduced over ``hidden``;
    backward ``dx = r (g w) - x r^3 mean_d(g w x)`` (one more all-reduce), ``dw = sum_rows g x r``."""

    @staticmethod
    def forward(ctx, x, w, hidden: GroupComm, d: int, eps: float):
        xf = x.float()
        ss = hidden.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        r = torch.rsqrt(ss / d + eps)
        ctx.save_for_backward(x, w, r)
        ctx.hidden, ctx.d = hidden, d
        return (xf * r * w.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        xf, gw = x.float(), g.float() * w.float()
        s = ctx.hidden.all_reduce((gw * xf).sum(-1, keepdim=True))
        dx = r * gw - xf * r.pow(3) * (s / ctx.d)
        dw = (g.float() * xf * r).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), None, None, None


class _LayerNorm(torch.autograd.Function):
    """``y = (x - m) r w + b`` with the mean ``m`` and ``r = (var + eps)^-1/2`` from sums all-reduced over ``hidden``;
    backward ``dx = r (g w - mean_d(g w) - xhat mean_d(g w xhat))`` (one all-reduce of both sums)."""

    @staticmethod
    def forward(ctx, x, w, b, hidden: GroupComm, d: int, eps: float):
        xf = x.float()
        m = hidden.all_reduce(xf.sum(-1, keepdim=True)) / d
        c = xf - m
        r = torch.rsqrt(hidden.all_reduce(c.pow(2).sum(-1, keepdim=True)) / d + eps)
        ctx.save_for_backward(x, w, m, r)
        ctx.hidden, ctx.d = hidden, d
        return (c * r * w.float() + b.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w, m, r = ctx.saved_tensors
        xhat = (x.float() - m) * r
        gf = g.float()
        gw = gf * w.float()
        sums = ctx.hidden.all_reduce(torch.cat([gw.sum(-1, keepdim=True), (gw * xhat).sum(-1, keepdim=True)], -1))
        dx = r * (gw - sums[..., :1] / ctx.d - xhat * sums[..., 1:] / ctx.d)
        rows = x.shape[-1]
        dw = (gf * xhat).reshape(-1, rows).sum(0)
        db = gf.reshape(-1, rows).sum(0)
        return dx.to(x.dtype), dw.to(w.dtype), db.to(w.dtype), None, None, None


class GridNorm(nn.Module):
    """RMSNorm (``bias=False``) or LayerNorm over features split on the hidden group (module docstring).

    Weight (and bias): block ``[d/q]`` of the features, held alike by the ranks of the token groups. Bytes per rank
    for ``n`` rows (ring, ``k`` ranks per group, ``p`` bytes per element): forward ``2 (q-1)/q 4n`` on the hidden
    group (LayerNorm twice: mean, then variance); backward ``2 (q-1)/q 4n`` (LayerNorm ``8n``: both sums at once)
    plus ``2 (k-1)/k p d/q`` per token group for the weight's gradient (and the bias's)."""

    def __init__(self, d: int, eps: float, layer_norm: bool, ctx: GridContext, device=None):
        super().__init__()
        self.ctx, self.d, self.eps = ctx, d, eps
        local = _split(d, ctx.q, "the model width")
        self.weight = set_spec(nn.Parameter(torch.empty(local, device=device)), ctx.feature_spec((d,), 0))
        self.bias = (
            set_spec(nn.Parameter(torch.empty(local, device=device)), ctx.feature_spec((d,), 0)) if layer_norm else None
        )

    def forward(self, x):
        w = self.ctx.shared(self.weight)
        if self.bias is None:
            return _RMSNorm.apply(x, w, self.ctx.hidden, self.d, self.eps)
        return _LayerNorm.apply(x, w, self.ctx.shared(self.bias), self.ctx.hidden, self.d, self.eps)


class _Transpose(torch.autograd.Function):
    """Swaps a block with the grid rank ``(j, i)`` of the same depth (its gradient swapped back in backward)."""

    @staticmethod
    def forward(ctx, w, tp: GroupComm, partner: int):
        ctx.tp, ctx.partner = tp, partner
        return _swap(w, tp, partner)

    @staticmethod
    def backward(ctx, g):
        return _swap(g.contiguous(), ctx.tp, ctx.partner), None, None


def _swap(t: torch.Tensor, tp: GroupComm, partner: int) -> torch.Tensor:
    if partner == tp.rank:
        return t.clone()
    out = torch.empty_like(t)
    for h in tp.batch_p2p([("send", t.contiguous(), partner), ("recv", out, partner)]):
        h.wait()
    return out


class GridEmbedding(nn.Module):
    """The token embedding on a grid (module docstring); ``tied``: its weight is (or will be) the output layer's.

    Bytes per rank, ``p`` per element, ``N`` tokens of the micro-batch. 2-D/2.5-D: forward ``(q-1) p V d/q^2``
    (the column all-gather), backward ``(q-1)/q p V d/q`` (its reduce-scatter) plus, for 2.5-D,
    ``2 (d-1)/d p V d/q^2`` over the depth; tied, an off-diagonal rank also sends ``p V d/q^2`` each way (the
    swap). 3-D: forward ``(q-1) p V d/q^3`` (column) + ``(q-1)/q p N d/q^2`` (the row's reduce-scatter of the
    column's ``N/q`` tokens), backward the same two reversed."""

    is_embedding = True  # a lookup table: no weight decay

    def __init__(self, vocab: int, d: int, ctx: GridContext, tied: bool, device=None):
        super().__init__()
        q, self.ctx, self.vocab, self.d = ctx.q, ctx, vocab, d
        _split(vocab, q, "the vocabulary")
        u = ctx.row.rank
        self.vocab_start = u * vocab // q  # 3-D: this rank's vocabulary slice
        if ctx.grid.mode == "3d":
            shape = (vocab // q, _split(d, q * q, "the model width (3-D: q^2 blocks)"))
            offset = (u * vocab // q, ctx.dep.rank * d // q + ctx.col.rank * d // (q * q))
            primary = True
        else:
            shape = (vocab // q, _split(d, q, "the model width"))
            i, j = ctx.col.rank, ctx.row.rank
            offset = (j * vocab // q, i * d // q) if tied else (i * vocab // q, j * d // q)
            primary = ctx.dep is None or ctx.dep.rank == 0
        self.tied = tied
        self.weight = set_spec(
            nn.Parameter(torch.empty(shape, device=device)), TPSpec((vocab, d), offset, primary=primary)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ctx, w = self.ctx, self.weight
        if ctx.grid.mode == "3d":
            ids = ids.chunk(ctx.q)[ctx.col.rank]  # the column's samples (every row sub-block)
            table = gather_sequence(w, ctx.col, dim=1)  # [V/q, d/q]; backward: reduce-scatter over the column
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + table.shape[0])
            local = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), table)
            local = local.masked_fill(outside.unsqueeze(-1), 0.0)
            return reduce_scatter_sequence(local, ctx.row, dim=0)  # summed over the vocabulary slices
        if ctx.dep is not None:
            w = copy_to_region(w, ctx.dep)  # the depth layers' gradients summed
        if self.tied:
            i, j, k = ctx.col.rank, ctx.row.rank, ctx.dep.rank if ctx.dep is not None else 0
            w = _Transpose.apply(w, ctx.tp, ctx.grid.rank(j, i, k))
        table = gather_sequence(w, ctx.col, dim=0)  # [V, d/q]
        return F.embedding(ctx.rows(ids), table)


class GridPositions(nn.Module):
    """Learned positions ``[max_len, d]`` split by features like the residual stream (held alike over the tokens)."""

    is_embedding = True

    def __init__(self, max_len: int, d: int, ctx: GridContext, device=None):
        super().__init__()
        self.ctx = ctx
        local = _split(d, ctx.q, "the model width")
        self.weight = set_spec(
            nn.Parameter(torch.empty(max_len, local, device=device)), ctx.feature_spec((max_len, d), 1)
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.dim() != 1:
            raise ValueError(
                "per-sample positions (left-padded decoding) need 1-D tensor parallelism (parallel.tp_mode=1d)"
            )
        return F.embedding(positions, self.ctx.shared(self.weight))


class GridLoss(OutputLoss):
    """Mean token cross-entropy from vocabulary-split logits on a grid (module docstring); unfused.

    Bytes per rank beyond the output layer's, for ``n`` rows of logits: forward three all-reduces of ``[n]`` fp32 over
    the row (``3 x 2 (q-1)/q 4n``: max, sum of exponentials, target logit) and two of one fp32 over each of the
    logits' token groups (the token count, the loss); backward none."""

    def __init__(self, ctx: GridContext):
        super().__init__(fused=False)
        self.ctx = ctx

    def forward(self, h: torch.Tensor, output: nn.Module, target: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        logits = output(h)
        target = ctx.rows(target, logits=True).to(logits.device).flatten()
        v = logits.shape[-1]
        losses = vocab_parallel_losses(logits.flatten(0, -2), target, ctx.vocab, ctx.vocab.rank * v)
        count = (target != IGNORE_INDEX).sum(dtype=torch.float32)
        for g in ctx.logit_tokens:
            g.all_reduce(count)
        loss = losses.sum() / count.clamp(min=1.0)
        for g in ctx.logit_tokens:
            loss = reduce_from_region(loss, g)
        return loss


__all__ = ["GridContext", "GridEmbedding", "GridLoss", "GridNorm", "GridPositions"]
