"""1-D tensor parallelism (Megatron-LM) with sequence parallelism: the layers.

``tp`` ranks share every matrix of a block. With ``X`` the block input ``[B, T, d]``:

* :class:`ColumnParallelLinear` ``Y = X A``: ``A [d_in, d_out]`` split by *columns*; rank ``i``
  holds ``A_i`` (``d_out / tp`` outputs; PyTorch stores ``weight = A^T`` so rows of ``weight``)
  and computes ``Y_i = X A_i``, its slice of the outputs (for attention: its heads). No
  communication of its own.
* :class:`RowParallelLinear` ``Z = Y B``: ``B`` split by *rows* (``d_in / tp`` inputs each); rank
  ``i`` computes the partial sum ``Y_i B_i`` and the exit collective adds them up; the bias is
  added once, after it.
* The region's collectives (see :mod:`trickles.comm`): entering, ``copy_to_region`` (forward
  identity, backward all-reduce of ``dX``); leaving, ``reduce_from_region`` (forward all-reduce,
  backward identity). One all-reduce each way per attention and per MLP.
* **Sequence parallel**: outside the matmuls (norms, dropout, residual adds) each rank keeps
  ``T / tp`` positions. Entering becomes ``gather_sequence`` (all-gather forward, reduce-scatter
  backward), leaving ``reduce_scatter_sequence`` (reduce-scatter forward, all-gather backward):
  the same bytes as the two all-reduces, while the activations outside the matmuls shrink by
  ``tp``. Parameters used on sequence shards (norm weights, the row-parallel bias) get only the
  part of their gradient from their own positions; those gradients are summed over the group.
* :class:`VocabParallelEmbedding`: the table split by *rows* (vocabulary ranges); a rank looks up the ids in its range,
  zeros the others, and the all-reduce (or, for sequence parallel, a reduce-scatter) completes every row. The output
  projection is column-parallel over the vocabulary and
  :func:`~trickles.parallel.tensor.loss.vocab_parallel_cross_entropy` computes the loss from the logit shards (max and
  sum of exponentials reduced over the group) without gathering the logits; a tied output projection shares the
  embedding's shard, which is split the same way.
* q/k norms: a per-head one (``model.qk_norm=head``) is local to a rank, its weight replicated and its gradient (from
  this rank's heads) summed; a full-width one is :class:`SplitWidthRMSNorm`, its weight split with the heads.
* Grouped-query attention: query heads are split ``n_heads / tp`` per rank. If ``n_kv_heads``
  divides by ``tp`` the key/value projections are split the same way; otherwise each rank keeps
  the whole (small) key/value projection (:class:`ReplicatedKV`), computes all key/value heads
  and picks the ones its query heads use; its weight gradient is then partial and summed.

Every parameter carries a :class:`TPSpec`: its global shape and the offset of the block this
rank holds, which initialization (the full tensor computed, then sliced) and checkpoints use.

The bytes these layers send, and the partial gradients they leave, are :mod:`~trickles.parallel.tensor.region_bytes`'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import GroupComm, copy_to_region, gather_sequence, reduce_from_region, reduce_scatter_sequence
from ..pipeline.split import phase


@dataclass(frozen=True)
class TPSpec:
    """Where a rank's parameter sits in the global one, and how its gradient completes."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    partial_grad: bool = False  # each rank holds part of the gradient of a replicated parameter: sum over tp
    replicated: bool = False  # every tp rank holds the same values (counted once in the gradient norm)
    ep_sharded: bool = False  # an expert-parallel block of experts (its gradient: over edp, then / ep)
    # of the tp ranks holding this same block (a grid's norm weights, biases, 2.5-D weights: :mod:`.grid_linear`),
    # whether this one counts it in the gradient norm and writes it to checkpoints (``replicated``: tp rank 0 does)
    primary: bool = True

    def block(self, local_shape) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, local_shape))


def set_spec(p: nn.Parameter, spec: TPSpec) -> nn.Parameter:
    p.tp_spec = spec
    return p


def replicated_spec(shape, partial: bool) -> TPSpec:
    return TPSpec(tuple(shape), (0,) * len(shape), partial_grad=partial, replicated=True)


class TPContext:
    """What the parallel layers of one model share: the group, and whether sequence parallelism is on.

    ``sp_active`` is decided per forward (by :func:`~trickles.parallel.tensor.plan.apply_tensor_parallel`'s
    root hook): sequence parallelism needs a sequence length divisible by ``tp`` and no KV cache.
    Under sequence parallelism the column-parallel layers after an all-gathered entry keep only
    this rank's sequence shard of their input for backward and all-gather it again there, once
    per region (Megatron-LM's choice: activations outside the matmuls all shrink by ``tp``, for
    one more all-gather per region in backward); layers built with ``regather=False`` (inside
    fully recomputed blocks, which keep nothing but their input) keep the gathered input.
    """

    def __init__(self, comm: GroupComm, sequence_parallel: bool):
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.sp_active = sequence_parallel
        self.vocab_start = 0  # first vocabulary id of this rank's logit shard
        self._entry: tuple[torch.Tensor, torch.Tensor, _Regather] | None = None

    def begin_forward(self, seq_len: int, decoding: bool = False) -> None:
        """Decides sequence parallelism for the forward about to run over ``seq_len`` positions.

        It needs a sequence that splits evenly over ``tp`` and no KV cache (decoding).
        """
        self.sp_active = self.sequence_parallel and not decoding and seq_len % self.comm.size == 0

    def activation_shape(self, b: int, t: int, d: int, decoding: bool = False) -> tuple[int, int, int]:
        """This rank's part of a ``[b, t, d]`` residual-stream activation (what pipeline stages send): the sequence
        shard under sequence parallelism."""
        if self.sequence_parallel and not decoding and t % self.comm.size == 0:
            t //= self.comm.size
        return (b, t, d)

    def end_forward(self) -> None:
        """Forgets the latest region entry, so no activation is held past the forward."""
        self._entry = None

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sp_active:
            return copy_to_region(x, self.comm)
        full = gather_sequence(x, self.comm, dim=1)
        if torch.is_grad_enabled():
            self._entry = (full, x, _Regather(self.comm))
        return full

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_sequence(y, self.comm, dim=1) if self.sp_active else reduce_from_region(y, self.comm)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, regather: bool = True
    ) -> torch.Tensor:
        """``F.linear`` of a region's input; keeps only the sequence shard when ``x`` is the latest gathered entry."""
        entry = self._entry
        if regather and entry is not None and entry[0] is x and torch.is_grad_enabled():
            return _LinearKeepingShard.apply(x, entry[1], weight, bias, entry[2])
        return F.linear(x, weight, bias)


class _Regather:
    """All-gathers a region's input again in backward, once for all the linears that read it."""

    def __init__(self, comm: GroupComm):
        self.comm = comm
        self.readers = 0
        self.full: torch.Tensor | None = None

    def take(self, shard: torch.Tensor | None) -> torch.Tensor | None:
        """The gathered input for one reader (None: ``shard`` None, a reader that needs no weight gradient: it only
        counts itself off, and gathers nothing)."""
        if self.full is None and shard is not None:
            self.full = self.comm.all_gather(shard.contiguous(), dim=1)
        full = self.full
        self.readers -= 1
        if self.readers == 0:
            self.full = None
        return full


class _LinearKeepingShard(torch.autograd.Function):
    """``y = X W^T + b`` with ``X`` the all-gathered sequence; saves this rank's shard of ``X``, not ``X``.

    Backward: ``dX = dy W`` (flows back through the entry's reduce-scatter), ``dW = dy^T X`` and
    ``db = sum dy`` with ``X`` all-gathered again from the saved shard (shared by the region's linears).
    """

    @staticmethod
    def forward(ctx, full, shard, weight, bias, regather):
        ctx.save_for_backward(shard, weight)
        ctx.regather, ctx.has_bias, ctx.in_dtype = regather, bias is not None, full.dtype
        regather.readers += 1
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, g):
        shard, weight = ctx.saved_tensors
        g = g.contiguous()
        step = phase()  # a zero-bubble schedule's B (the input's gradient) or W (the weights')
        dx = None if step == "weight" else g.matmul(weight.to(g.dtype)).to(ctx.in_dtype)
        if step == "input":
            return dx, None, None, None, None
        if not (ctx.needs_input_grad[2] or ctx.needs_input_grad[3]):  # a frozen weight (LoRA's base): no dW, no gather
            ctx.regather.take(None)
            return dx, None, None, None, None
        full = ctx.regather.take(shard)
        g2 = g.flatten(0, -2)
        dw = g2.t().matmul(full.flatten(0, -2).to(g.dtype)).to(weight.dtype)
        db = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx, None, dw, db, None


def _shard(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} ({n}) is not divisible by tensor-parallel degree {tp}")
    return n // tp


class ColumnParallelLinear(nn.Module):
    """``y_i = x W_i^T + b_i`` with ``W`` split along its output rows; input already in the region."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, ctx: TPContext, device=None, regather: bool = True
    ):
        super().__init__()
        tp, r = ctx.comm.size, ctx.comm.rank
        local = _shard(out_features, tp, "output features")
        self.ctx, self.regather = ctx, regather
        self.in_features, self.out_features = in_features, local
        self.weight = set_spec(
            nn.Parameter(torch.empty(local, in_features, device=device)),
            TPSpec((out_features, in_features), (r * local, 0)),
        )
        self.bias = (
            set_spec(nn.Parameter(torch.empty(local, device=device)), TPSpec((out_features,), (r * local,)))
            if bias
            else None
        )

    def forward(self, x):
        return self.ctx.linear(x, self.weight, self.bias, self.regather)


class RowParallelLinear(nn.Module):
    """``y = sum_i x_i W_i^T + b`` with ``W`` split along its input columns; leaves the region."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: TPContext, device=None):
        super().__init__()
        tp, r = ctx.comm.size, ctx.comm.rank
        local = _shard(in_features, tp, "input features")
        self.ctx = ctx
        self.in_features, self.out_features = local, out_features
        self.weight = set_spec(
            nn.Parameter(torch.empty(out_features, local, device=device)),
            TPSpec((out_features, in_features), (0, r * local)),
        )
        self.bias = (
            set_spec(
                nn.Parameter(torch.empty(out_features, device=device)),
                replicated_spec((out_features,), partial=ctx.sequence_parallel),
            )
            if bias
            else None
        )

    def forward(self, x):
        y = self.ctx.leave(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class ReplicatedKV(nn.Module):
    """Key or value projection kept whole on every rank; outputs the heads this rank's query heads use.

    Query head ``j`` (global) uses key/value head ``j // (n_heads / n_kv_heads)``; the output has
    one key/value head per local query head, so attention proceeds without grouping.
    """

    def __init__(
        self,
        in_features: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        bias: bool,
        ctx: TPContext,
        device=None,
        regather: bool = True,
    ):
        super().__init__()
        tp, r = ctx.comm.size, ctx.comm.rank
        local_q = _shard(n_heads, tp, "query heads")
        group = n_heads // n_kv_heads
        self.ctx, self.regather = ctx, regather
        self._heads = [(r * local_q + j) // group for j in range(local_q)]
        self.head_dim = head_dim
        self.in_features, self.out_features = in_features, local_q * head_dim
        out = n_kv_heads * head_dim
        self.weight = set_spec(
            nn.Parameter(torch.empty(out, in_features, device=device)),
            replicated_spec((out, in_features), partial=True),
        )
        self.bias = (
            set_spec(nn.Parameter(torch.empty(out, device=device)), replicated_spec((out,), partial=True))
            if bias
            else None
        )

    def forward(self, x):
        kv = self.ctx.linear(x, self.weight, self.bias, self.regather)
        kv = kv.view(*kv.shape[:-1], -1, self.head_dim)[..., self._heads, :]
        return kv.reshape(*kv.shape[:-2], -1)


class SplitWidthRMSNorm(nn.Module):
    """Full-width q/k RMSNorm (``model.qk_norm=full``) of heads split over the group: this rank's ``[B, T, h/tp, D]``
    normalized over all ``h D`` of them, with its slice of the weight ``[h D]`` (split with the heads).

    The mean square needs every rank's heads: the local sum of squares ``s_i`` is all-reduced in forward, ``S = sum_i
    s_i``, and since every rank's heads use ``S``, the gradient of ``s_i`` is the all-reduce of theirs in backward
    (``copy_to_region`` then ``reduce_from_region``: one ``[B, T, 1]`` fp32 all-reduce each way, in the ledger).
    ``offset``: by ``1 + weight``, in fp32 to the end (``model.norm_unit_offset``).
    """

    def __init__(self, width: int, eps: float, ctx: TPContext, device=None, offset: bool = False):
        super().__init__()
        tp, r = ctx.comm.size, ctx.comm.rank
        local = _shard(width, tp, "q/k norm width")
        self.ctx, self.eps, self.width, self.offset = ctx, eps, width, offset
        self.weight = set_spec(nn.Parameter(torch.empty(local, device=device)), TPSpec((width,), (r * local,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.flatten(-2).float()
        comm = self.ctx.comm
        total = reduce_from_region(copy_to_region(xf.pow(2).sum(-1, keepdim=True), comm), comm)
        rstd = torch.rsqrt(total / self.width + self.eps)
        if self.offset:
            return (xf * rstd * (1.0 + self.weight.float())).type_as(x).view_as(x)
        return (self.weight * (xf * rstd).type_as(x)).view_as(x)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[r V/tp, (r+1) V/tp)`` of the table on rank ``r``; other ids contribute zeros, summed over the group.

    The sum leaves the region like a row-parallel layer: all-reduce forward (identity backward),
    or with sequence parallelism a reduce-scatter to this rank's positions (all-gather backward).
    """

    is_embedding = True  # a lookup table: no weight decay

    def __init__(self, vocab: int, dim: int, ctx: TPContext, device=None):
        super().__init__()
        tp, r = ctx.comm.size, ctx.comm.rank
        local = _shard(vocab, tp, "vocabulary size")
        self.ctx = ctx
        self.start, self.end = r * local, (r + 1) * local
        self.weight = set_spec(
            nn.Parameter(torch.empty(local, dim, device=device)), TPSpec((vocab, dim), (r * local, 0))
        )

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.ctx.leave(local)  # all-reduce, or reduce-scatter to sequence shards


def enter_after(norm: nn.Module, ctx: TPContext) -> nn.Module:
    """Makes ``norm``'s output enter the tensor-parallel region (copy, or all-gather of the sequence).

    A forward hook, so the norm keeps its place and its parameters keep their names.
    """
    norm.register_forward_hook(lambda module, args, out: ctx.enter(out))
    return norm


class ForkRNG(nn.Module):
    """Runs ``inner`` (a dropout, or the attention core of ``owner``) with a random stream private to this tp rank.

    Used where ranks hold different data: attention heads inside the region, and sequence
    shards under sequence parallelism. The private seed is drawn from the default generator
    (the same draw on every rank, so the shared stream stays in step) and mixed with the rank:
    it is a function of the default generator's state, which checkpoints record and activation
    recomputation restores. Without dropout (or in eval) it runs ``inner`` directly.
    """

    def __init__(self, inner, ctx: TPContext, rate: float, owner: nn.Module | None = None):
        super().__init__()
        self.inner = inner if isinstance(inner, nn.Module) else None
        self._fn = inner
        self.ctx, self.rate = ctx, rate
        object.__setattr__(self, "_owner", owner)  # not a submodule: the owner contains this

    def forward(self, *args, **kwargs):
        training = (self._owner or self).training
        if self.rate == 0 or not training:
            return self._fn(*args, **kwargs)
        seed = int(torch.randint(0, 2**62, (1,)).item())
        device = next((a.device for a in args if torch.is_tensor(a)), torch.device("cpu"))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            torch.manual_seed((seed + 7919 * (self.ctx.comm.rank + 1)) % (2**63))
            return self._fn(*args, **kwargs)


def init_tp_param(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's block of the full initial value ``full`` of parameter ``p``."""
    spec = getattr(p, "tp_spec", None)
    if spec is None or tuple(spec.global_shape) == tuple(p.shape):
        return full
    return full[spec.block(p.shape)]
