"""Ring attention for context parallelism (:mod:`trickles.parallel.context`), with sliding windows, soft-capped
scores and packed documents' block masks.

**Ring** (``parallel.cp_mode = "ring"``). The sequence is cut into ``2 cp`` chunks of ``c = T / (2 cp)``
tokens; rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (positions ``[i c, (i+1) c)`` and
``[(2 cp - 1 - i) c, (2 cp - i) c)``), so under the causal mask every rank has the same work. On ring
step ``s = 0 .. cp-1`` rank ``i`` holds the keys and values of rank ``j = i - s (mod cp)``, and while it
attends to them it already sends them on to rank ``i + 1`` and receives rank ``j - 1``'s from rank
``i - 1`` (one non-blocking send and receive, ``cp - 1`` per layer). For query chunk ``a`` and key chunk
``b``: ``b < a`` attends fully, ``b = a`` with the causal triangle, ``b > a`` is above the diagonal and
skipped (never computed). Each step thus computes half of the ``2 x 2`` chunk pairs -- for ``j < i``
both query chunks against key chunk ``j``; for ``j > i`` query chunk ``2 cp - 1 - i`` against both -- and step 0 the
two diagonal blocks and one full block. Which blocks run, and how they are cut, is
:mod:`~trickles.parallel.ring_plan`'s: on a CPU a diagonal block in quarters down to pieces of ``c / 8`` rows (each
causal kernel then computes a small triangle), and with a sliding window (``model.sliding_window`` on the layer) a
block wholly outside the window skipped, a block the window's edge crosses cut the same way, the pieces along the
edge masked. With packed documents, pieces no document spans are skipped too.

The merge is exact: a block gives ``o_b = softmax(S_b) V_b`` and ``lse_b = log sum exp S_b`` per query
row (fp32); with ``lse = logaddexp(lse_acc, lse_b)``,
``o = o_acc exp(lse_acc - lse) + o_b exp(lse_b - lse)`` is the softmax over the union of the keys,
because ``exp(S) / sum exp(S)`` over a union splits into each part's weights times its share
``exp(lse_part - lse)``. The order of the blocks changes only rounding.

Backward runs the ring again with the saved output ``O`` and ``lse``: per block ``P = exp(S - lse)``, ``dV += P^T dO``,
``dS = P (dO V^T - rowsum(dO O))``, ``dQ += dS K scale``, ``dK += dS^T Q scale`` (``S = Q K^T scale``, the layer's
scale, ``1 / sqrt(D)`` unless set). The keys and values travel as in forward; their gradients (fp32) travel with them,
each rank adding its part, and after ``cp`` sends are back with their owner. With a window only the chunks some rank
further on sees travel, and a block's gradient starts at the first rank after its owner that sees it, the owner keeping
its own part until the sum comes home (:func:`~trickles.parallel.ring_plan.route`). Grouped-query attention sends only
the ``H_kv`` key/value heads (each rank repeats them to its query heads locally and sums the repeats' gradients). Each
block runs the device's fused kernel that returns the log-sum-exp (flash attention on a CPU, memory-efficient attention
on CUDA), else fp32 matmuls (:mod:`~trickles.parallel.ring_blocks`); soft-capped scores (``model.attn_softcap``) run
fp32 matmuls on the capped scores, with the cap's derivative in backward
(:class:`~trickles.parallel.ring_blocks.Capped`).

Values narrower than the keys (latent attention: ``v_head_dim < qk_nope + qk_rope``) are padded with zeros to the
keys' size before the ring, so one fused kernel and one message serve both, and the output's padding is cut off
(its gradient there is zero): ``D`` below is then the keys' size.

Bytes per layer per rank, ``B`` rows, ``t = T / cp`` local tokens, head dimension ``D``, ``e`` bytes per element: a
key/value block is ``2 B H_kv t D e``; forward sends ``(cp - 1)`` of them; backward sends ``(cp - 1)`` blocks and ``cp``
gradient blocks of ``2 B H_kv t D 4`` (a ring of one rank sends nothing). In flight at once: the block being used and
the one arriving (forward), plus one gradient block each way (backward). A window sends less: the chunks of
:func:`~trickles.parallel.ring_plan.route` (at cp=2 with ``w <= c``, half a block forward, and half a block and half
a gradient block backward), its rank holding its own gradient part besides through backward.
"""

from __future__ import annotations

import math

import torch

from ..comm import GroupComm
from .ring_blocks import Capped, kernel_for, merge
from .ring_plan import BOTH, NONE, Chunks, RingDocuments, Route, plain_blocks, route

__all__ = ["RingDocuments", "repeat_heads", "ring_attention"]


def _plan(rank: int, cp: int, c: int, documents: RingDocuments | None, window: int | None, device) -> list[list]:
    """Each ring step's blocks ``(q slice, kv slice, causal, mask or None)``, planned once per layer call (forward
    keeps them for backward), a band mask built once per distinct shape."""
    if documents is not None:
        return [documents.blocks(rank, (rank - step) % cp, cp, c, window) for step in range(cp)]
    masks: dict = {}
    return [plain_blocks(rank, (rank - step) % cp, cp, c, window, device, masks) for step in range(cp)]


def repeat_heads(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """``kv [B, H_kv, t, D]`` with each head repeated ``rep`` times (a no-op for 1)."""
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _swap(comm: GroupComm, send: torch.Tensor | None, recv: torch.Tensor | None) -> list:
    """Starts sending ``send`` to the next rank and receiving into ``recv`` from the previous one (either None:
    nothing moves that way)."""
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    ops = [op for op in (("send", send, nxt), ("recv", recv, prev)) if op[1] is not None]
    return comm.batch_p2p(ops) if ops else []


def _wait(handles) -> None:
    for h in handles:
        h.wait()


def _span(have: Chunks, chunk: int, c: int) -> slice:
    """Where chunk ``chunk`` (0: low, 1: high) lies along the tokens of a tensor holding the chunks ``have``."""
    start = c if chunk and have[0] else 0
    return slice(start, start + c)


def _keys(ks: slice, have: Chunks, c: int) -> slice:
    """A plan's key slice (local to a whole block) in a tensor holding the chunks ``have`` (its own among them)."""
    shift = c if ks.start >= c and not have[0] else 0
    return slice(ks.start - shift, ks.stop - shift)


def _tokens(x: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """A new tensor like ``x [..., tokens, D]`` with ``n`` chunks of ``c`` tokens."""
    return x.new_empty((*x.shape[:-2], n * c, x.shape[-1]))


def _take(kv, have: Chunks, want: Chunks, c: int) -> torch.Tensor | None:
    """The chunks ``want`` (some of ``have``) of the keys and values ``kv`` (a stacked ``[2, ..., tokens, D]`` or the
    pair ``(k, v)``) stacked in one contiguous message; None for none."""
    if not any(want):
        return None
    if want != have:
        kv = [x[..., _span(have, want.index(True), c), :] for x in kv]
    return kv if isinstance(kv, torch.Tensor) else torch.stack(list(kv))


def _summed(want: Chunks, c: int, *parts) -> torch.Tensor | None:
    """The sum of ``parts`` ``(tensor or None, the chunks it holds)`` as a tensor holding the chunks ``want`` (each
    part's among them), made in place in the first part holding just ``want``; None for no chunks or no parts."""
    parts = [(x, have) for x, have in parts if x is not None]
    if not any(want) or not parts:
        return None
    dst = next((x for x, have in parts if have == want), None)
    if dst is None:
        dst = _tokens(parts[0][0], sum(want), c).zero_()
    for x, have in parts:
        if x is not dst:
            for chunk in (0, 1):
                if have[chunk]:
                    dst[..., _span(want, chunk, c), :] += x[..., _span(have, chunk, c), :]
    return dst


def _pass(comm: GroupComm, kv, k: torch.Tensor, way: Route, step: int, c: int):
    """Step ``step`` of the ring: the chunks of the block ``kv`` (:func:`_take`'s; None: none held) that ranks further
    on see, posted to the next rank, and the previous rank's arriving into a buffer for keys and values like ``k``
    (not on the last step); returns the handles, that buffer and the chunks ``kv`` holds."""
    have = way.held[step]
    if step == comm.size - 1:
        return [], None, have
    want = way.held[step + 1]
    nxt = _tokens(k.expand(2, *k.shape), sum(want), c) if any(want) else None
    return _swap(comm, _take(kv, have, way.sent[step], c), nxt), nxt, have


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: GroupComm, documents: RingDocuments | None, window, scale, softcap):
        b, h, t, d = q.shape
        cp, rank = comm.size, comm.rank
        rep, c = h // k.shape[1], t // 2
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        out = torch.zeros((b, h, t, d), dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, t), float("-inf"), dtype=torch.float32, device=q.device)
        kernel = Capped(softcap) if softcap else kernel_for(q)
        # each step's blocks, planned once and kept for backward (their masks built once per layer call)
        plan, way = _plan(rank, cp, c, documents, window, q.device), route(rank, cp, c, window)
        kv = (k, v)  # then the stacked keys and values that arrive, one message per step
        for step in range(cp):
            handles, nxt, have = _pass(comm, kv, k, way, step, c)
            if plan[step]:
                kk, vv = repeat_heads(kv[0], rep), repeat_heads(kv[1], rep)
            for qs, ks, causal, mask in plan[step]:
                ks = _keys(ks, have, c)
                o_b, lse_b = kernel.forward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], scale, causal, mask)
                merge(out[:, :, qs], lse[:, :, qs], o_b, lse_b)
            _wait(handles)
            kv = nxt
        # laid out [B, t, H, D] like the fused kernels' output, so the heads side by side that ``o_proj``
        # keeps for its backward are a view of this same tensor (saved once)
        out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2).copy_(out)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.plan, ctx.way, ctx.scale, ctx.softcap = comm, plan, way, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, way = ctx.comm, ctx.way
        b, h, t, d = q.shape
        cp, h_kv, c = comm.size, k.shape[1], t // 2
        rep, scale = h // h_kv, ctx.scale
        kernel = Capped(ctx.softcap) if ctx.softcap else kernel_for(q)
        # rowsum(dO O), for the fp32 blocks (the fused kernels make their own)
        delta = (dout.float() * out.float()).sum(-1) if kernel.takes_delta else None
        dq = torch.zeros((b, h, t, d), dtype=torch.float32, device=q.device)
        kv = (k, v)
        home = None  # this rank's part of its own block's gradient, while the others' travel (Route.keep_home)
        dkv, dkv_handles = None, []  # the gradient message arriving (the ranks' before summed) and its handles
        for step in range(cp):
            handles, nxt, have = _pass(comm, kv, k, way, step, c)
            if ctx.plan[step]:
                kk, vv = repeat_heads(kv[0], rep), repeat_heads(kv[1], rep)
            seen = way.seen[step]
            part = torch.zeros((2, b, h, sum(seen) * c, d), dtype=torch.float32, device=q.device)
            for qs, ks, causal, mask in ctx.plan[step]:
                dq_b, dk_b, dv_b = kernel.backward(
                    q[:, :, qs],
                    kk[:, :, _keys(ks, have, c)],
                    vv[:, :, _keys(ks, have, c)],
                    dout[:, :, qs],
                    out[:, :, qs],
                    lse[:, :, qs],
                    None if delta is None else delta[:, :, qs],
                    scale,
                    causal,
                    mask,
                )
                dq[:, :, qs] += dq_b
                part[0][:, :, _keys(ks, seen, c)] += dk_b
                part[1][:, :, _keys(ks, seen, c)] += dv_b
            if rep > 1:  # the repeats' gradients back onto the key/value heads
                part = part.view(2, b, h_kv, rep, sum(seen) * c, d).sum(3)
            _wait(dkv_handles)
            if step == 0 and way.keep_home:
                home, part = part, None
            arrived = way.grad_recv[step - 1] if step else NONE
            send = _summed(way.grad_sent[step], c, (part, seen), (dkv, arrived))
            recv = way.grad_recv[step]
            dkv = _tokens(home if part is None else part, sum(recv), c) if any(recv) else None
            dkv_handles = _swap(comm, send, dkv)  # on to the next rank; after the last step, home
            _wait(handles)
            kv = nxt
        _wait(dkv_handles)
        dkv = _summed(BOTH, c, (home, way.seen[0]), (dkv, way.grad_recv[-1]))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: GroupComm,
    documents: RingDocuments | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's ``q [B, H, t, D]`` over every rank's ``k, v [B, H_kv, t, D]``,
    tokens in the ring layout (:func:`positions`); returns ``[B, H, t, D]``. With ``documents``, within each
    packed document (:class:`RingDocuments`); with ``window``, a query at ``q`` sees keys ``q - window < k <= q``
    only (blocks wholly outside it skipped, :mod:`~trickles.parallel.ring_plan`). Scores are
    ``q k^T scale`` (None: ``1 / sqrt(D)``), soft-capped to ``softcap tanh(s / softcap)`` when given (then every
    block runs :class:`~trickles.parallel.ring_blocks.Capped`)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two equal chunks per rank; got {q.shape[2]} local tokens")
    dv = v.shape[-1]
    if dv != q.shape[-1]:  # latent attention's values are narrower: padded to the key size, the pad cut off again
        if dv > q.shape[-1]:
            raise ValueError(f"ring attention takes values at most as wide as the keys, got {dv} > {q.shape[-1]}")
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
        return _RingAttention.apply(q, k, v, comm, documents, window, scale, softcap)[..., :dv]
    return _RingAttention.apply(q, k, v, comm, documents, window, scale, softcap)
