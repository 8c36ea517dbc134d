"""Context parallelism: every sequence split over the ``cp`` ranks, attention exchanged between them.

Weights are replicated over the ``cp`` ranks exactly like data parallelism: each cp rank runs the
whole model on its ``T / cp`` tokens of every sequence, the loss is its mean over those tokens, and
the gradients are averaged over the combined ``dp x cp`` group (every rank holds the same number of
tokens, so the average of the per-rank means is the mean over the global batch). Everything except
attention is per token; attention needs the other ranks' keys and values. Two ways:

**Ring** (``parallel.cp_mode = "ring"``). The sequence is cut into ``2 cp`` chunks of ``c = T / (2 cp)``
tokens; rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (positions ``[i c, (i+1) c)`` and
``[(2 cp - 1 - i) c, (2 cp - i) c)``), so under the causal mask every rank has the same work. On ring
step ``s = 0 .. cp-1`` rank ``i`` holds the keys and values of rank ``j = i - s (mod cp)``, and while it
attends to them it already sends them on to rank ``i + 1`` and receives rank ``j - 1``'s from rank
``i - 1`` (one non-blocking send and receive, ``cp - 1`` per layer). For query chunk ``a`` and key chunk
``b``: ``b < a`` attends fully, ``b = a`` with the causal triangle, ``b > a`` is above the diagonal and
skipped (never computed). Each step thus computes half of the ``2 x 2`` chunk pairs -- for ``j < i``
both query chunks against key chunk ``j``; for ``j > i`` query chunk ``2 cp - 1 - i`` against both --
and step 0 the two diagonal blocks and one full block.

The merge is exact: a block gives ``o_b = softmax(S_b) V_b`` and ``lse_b = log sum exp S_b`` per query
row (fp32); with ``lse = logaddexp(lse_acc, lse_b)``,
``o = o_acc exp(lse_acc - lse) + o_b exp(lse_b - lse)`` is the softmax over the union of the keys,
because ``exp(S) / sum exp(S)`` over a union splits into each part's weights times its share
``exp(lse_part - lse)``. The order of the blocks changes only rounding.

Backward runs the ring again with the saved output ``O`` and ``lse``: per block
``P = exp(S - lse)``, ``dV += P^T dO``, ``dS = P (dO V^T - rowsum(dO O))``, ``dQ += dS K / sqrt(D)``,
``dK += dS^T Q / sqrt(D)``. The keys and values travel as in forward (``cp - 1`` sends); their
gradients (fp32) travel with them, each rank adding its part, and after ``cp`` sends are back with
their owner. Grouped-query attention sends only the ``H_kv`` key/value heads (each rank repeats them to
its query heads locally and sums the repeats' gradients).

Bytes per layer per rank, ``B`` rows, ``t = T / cp`` local tokens, head dimension ``D``, ``e`` bytes
per element: a key/value block is ``2 B H_kv t D e``; forward sends ``(cp - 1)`` of them; backward
sends ``(cp - 1)`` blocks and ``cp`` gradient blocks of ``2 B H_kv t D 4`` (a ring of one rank sends nothing). In flight at once: the
block being used and the one arriving (forward), plus one gradient block each way (backward).

**All-to-all** (``parallel.cp_mode = "ulysses"``). Rank ``i`` holds the contiguous positions
``[i t, (i+1) t)``. Before attention one all-to-all per tensor trades sequence shards for head
shards -- ``q [B, H, t, D] -> [B, H / cp, T, D]``, likewise ``k`` and ``v`` -- attention runs on
whole sequences for ``H / cp`` heads (the model's own attention, causal), and one all-to-all trades
the output back. Four all-to-alls forward and, by autograd, the four reverse ones backward; each
sends ``(cp - 1) / cp`` of its tensor: ``(cp - 1) / cp * B t D e * (2 H + 2 H_kv')`` per layer each
way, where ``H_kv' = H_kv`` when ``cp`` divides it, else the key/value heads are first repeated
``f = cp / gcd(H_kv, cp)`` times (``H_kv' = f H_kv``; each copy then serves ``H / (f H_kv)`` query
heads, so every rank receives exactly the key/value heads its query heads use). Needs ``cp`` to
divide the (tensor-parallel rank's) query heads.

Positions: the rotary tables and learned position embeddings are looked up at each token's global
position (:class:`CPContext.positions`), so the model computes what it computes on one process.
Decoding with a KV cache (sampling, ``generate``) does not split the sequence: every cp rank then
runs the whole prompt, like a data-parallel replica. Mixture-of-experts blocks route each rank's tokens
and complete their per-sequence capacity and load-balancing statistics over the cp ranks
(:func:`trickles.parallel.expert.split_sequence`).
"""

from __future__ import annotations

import math

import torch

from ..comm import GroupComm, all_to_all
from ..models.documents import DocumentMask, document_positions
from ..models.transformer import Transformer
from .expert import split_sequence
from .sequence import positions, shard_sequence, unshard_sequence  # noqa: F401 (the last two re-exported)

MODES = ("ring", "ulysses")


class CPContext:
    """What the swapped-in attention and position lookups share: the group, the mode, and whether
    the forward now running is split over the cp ranks (no KV cache)."""

    def __init__(self, comm: GroupComm, mode: str):
        if mode not in MODES:
            raise ValueError(f"context-parallel mode must be one of {MODES}, got {mode!r}")
        self.comm, self.mode = comm, mode
        self.active = False
        self._positions: dict[tuple[int, str], torch.Tensor] = {}

    def begin_forward(self, local_len: int, decoding: bool = False) -> None:
        """Decides for the forward about to run (and stays so for its backward, where recomputation runs
        parts of it again): split unless decoding with a KV cache."""
        self.active = self.comm.size > 1 and not decoding
        self.local_len = local_len

    def positions(self, device) -> torch.Tensor:
        """Global positions of this rank's tokens in the forward now running."""
        key = (self.local_len, str(device))
        if key not in self._positions:
            self._positions[key] = positions(self.local_len * self.comm.size, self.comm.size, self.comm.rank, self.mode).to(device)
        return self._positions[key]


# ---- ring attention ----------------------------------------------------------------------------

def _chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _pairs(q_rank: int, kv_rank: int, cp: int, c: int):
    """``(q slice, kv slice, causal, a, b)`` of every block of ``q_rank``'s queries against ``kv_rank``'s keys
    that is not above the diagonal (local token offsets; ``a``, ``b``: the two chunks' places in the sequence)."""
    for qa, a in enumerate(_chunk_ids(q_rank, cp)):
        for kb, b in enumerate(_chunk_ids(kv_rank, cp)):
            if b <= a:
                yield slice(qa * c, (qa + 1) * c), slice(kb * c, (kb + 1) * c), b == a, a, b


class BlockMask:
    """One ring block's same-document mask ``[B, 1, c, c]`` (True: the query sees the key), with what the kernels
    take: the additive form in the inputs' type (cached) and which query rows see any key at all."""

    def __init__(self, mask: torch.Tensor):
        self.mask, self.rows = mask, mask.any(-1)  # [B, 1, c]
        self._additive: dict[torch.dtype, torch.Tensor] = {}

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._additive:
            zero = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive[dtype] = zero.masked_fill(~self.mask, float("-inf"))
        return self._additive[dtype]


class RingDocuments:
    """Packed documents' masks for the ring's blocks (``data.document_mask``): every rank holds the whole
    sequence's document ids ``[B, T]`` -- on the host (:attr:`host`, where the loader made them) and on the device.

    Block ``(a, b)`` of query chunk ``a`` against key chunk ``b <= a`` pairs tokens of one document only where
    ``doc(last key of b) == doc(first query of a)`` in some row (the ids never decrease along a row); where no
    row has such a pair the block is **skipped** (its keys and values still travel on). Where every row's two
    chunks lie in one document the block runs unmasked, as without documents (causal on the diagonal); otherwise
    with the mask ``doc_q == doc_k`` (and the causal triangle on the diagonal), built once per forward and reused
    by backward (:class:`BlockMask`: on a CPU the fused kernel takes it in additive form, and a query row that sees
    no key of the block gets log-sum-exp ``-inf``, where the kernel reports 0; elsewhere the fp32 matmul blocks). All three decisions are read from the host ids: the device is never waited for."""

    def __init__(self, host: torch.Tensor, device_ids: torch.Tensor):
        self.host, self.ids = host, device_ids
        self._blocks: dict[tuple[int, int, int], list] = {}

    def blocks(self, q_rank: int, kv_rank: int, cp: int, c: int) -> list:
        """``(q slice, kv slice, causal, mask or None)`` of the blocks to compute (module doc)."""
        key = (q_rank, kv_rank, c)
        if key not in self._blocks:
            out = []
            for qs, ks, causal, a, b in _pairs(q_rank, kv_rank, cp, c):
                first_q, last_q = self.host[:, a * c], self.host[:, a * c + c - 1]
                first_k, last_k = self.host[:, b * c], self.host[:, b * c + c - 1]
                if not causal and not bool((last_k == first_q).any()):
                    continue  # no row pairs a query with a key of its document
                if bool((first_k == last_q).all()):
                    out.append((qs, ks, causal, None))  # one document throughout, in every row
                    continue
                dq, dk = self.ids[:, a * c:(a + 1) * c], self.ids[:, b * c:(b + 1) * c]
                mask = dq[:, None, :, None] == dk[:, None, None, :]
                if causal:
                    mask = mask & torch.ones(c, c, dtype=torch.bool, device=mask.device).tril()
                out.append((qs, ks, False, BlockMask(mask)))
            self._blocks[key] = out
        return self._blocks[key]


def _blocks(q_rank: int, kv_rank: int, cp: int, c: int, documents: RingDocuments | None):
    if documents is not None:
        return documents.blocks(q_rank, kv_rank, cp, c)
    return [(qs, ks, causal, None) for qs, ks, causal, _, _ in _pairs(q_rank, kv_rank, cp, c)]


def _expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _scores(q, k, scale, causal, mask: BlockMask | None = None):
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:  # a diagonal block: query i sees keys 0..i
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    if mask is not None:  # packed documents: query i sees key j of its own document only
        s.masked_fill_(~mask.mask, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key yet (``-inf``) set to 0, so that ``exp(s - lse)`` is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _fused(q: torch.Tensor) -> bool:
    """Whether a block runs PyTorch's fused CPU attention kernel (it returns the log-sum-exp and takes the final
    output and log-sum-exp in backward); elsewhere the blocks are plain matmuls in fp32."""
    return q.device.type == "cpu"


def _block_forward(q, k, v, scale, causal, mask: BlockMask | None = None):
    """``(softmax(S) V, logsumexp(S))`` of one block, fp32 (a row ``mask`` hides entirely: 0 and ``-inf``)."""
    if _fused(q):
        extra = {} if mask is None else {"attn_mask": mask.additive(q.dtype)}
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale, **extra)
        if mask is not None:  # the kernel gives a row that sees no key 0 and log-sum-exp 0: make it -inf
            lse = lse.masked_fill(~mask.rows, float("-inf"))
        return o.float(), lse.float()
    s = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return torch.matmul(p.to(v.dtype), v).float(), lse


def _block_backward(q, k, v, do, out, lse, delta, scale, causal, mask: BlockMask | None = None):
    """``(dq, dk, dv)`` of one block (fp32) from the final output ``out``, its ``lse`` and
    ``delta = rowsum(dO O)``: ``P = exp(S - lse)`` is this block's share of the final softmax."""
    if _fused(q):
        extra = {} if mask is None else {"attn_mask": mask.additive(q.dtype)}
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.to(q.dtype), q, k, v, out, lse, 0.0, causal, scale=scale, **extra)
        return tuple(g.float() for g in grads)
    q, k, v, do = q.float(), k.float(), v.float(), do.float()
    p = torch.exp(_scores(q, k, scale, causal, mask) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta[..., None])
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _exchange(comm: GroupComm, send: torch.Tensor, recv: torch.Tensor):
    """Starts sending ``send`` to the next rank and receiving into ``recv`` from the previous one."""
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    return comm.batch_p2p([("send", send, nxt), ("recv", recv, prev)])


def _wait(handles) -> None:
    for h in handles:
        h.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: GroupComm, documents: RingDocuments | None):
        b, h, t, d = q.shape
        cp, rank = comm.size, comm.rank
        rep, c, scale = h // k.shape[1], t // 2, 1.0 / math.sqrt(d)
        out = torch.zeros((b, h, t, d), dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, t), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # one message per step
        for step in range(cp):
            handles, nxt = [], None
            if step < cp - 1:
                nxt = torch.empty_like(kv)
                handles = _exchange(comm, kv, nxt)
            src = (rank - step) % cp
            kk, vv = _expand(kv[0], rep), _expand(kv[1], rep)
            for qs, ks, causal, mask in _blocks(rank, src, cp, c, documents):
                o_b, lse_b = _block_forward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], scale, causal, mask)
                new = torch.logaddexp(lse[:, :, qs], lse_b)
                safe = _finite(new)  # (a row no block has shown a key yet stays 0 and -inf)
                out[:, :, qs] = out[:, :, qs] * torch.exp(lse[:, :, qs] - safe)[..., None] + o_b * torch.exp(lse_b - safe)[..., None]
                lse[:, :, qs] = new
            _wait(handles)
            kv = nxt
        # laid out [B, t, H, D] like the fused kernels' output, so the heads side by side that ``o_proj``
        # keeps for its backward are a view of this same tensor (saved once)
        out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2).copy_(out)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.documents = comm, documents
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm = ctx.comm
        b, h, t, d = q.shape
        cp, rank = comm.size, comm.rank
        h_kv = k.shape[1]
        rep, c, scale = h // h_kv, t // 2, 1.0 / math.sqrt(d)
        do = dout.float()
        delta = (do * out.float()).sum(-1)
        dq = torch.zeros((b, h, t, d), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv, dkv_handles = None, []  # the gradient block arriving with the keys and values being held
        for step in range(cp):
            handles, nxt = [], None
            if step < cp - 1:
                nxt = torch.empty_like(kv)
                handles = _exchange(comm, kv, nxt)
            src = (rank - step) % cp
            kk, vv = _expand(kv[0], rep), _expand(kv[1], rep)
            part = torch.zeros((2, b, h, t, d), dtype=torch.float32, device=q.device)
            for qs, ks, causal, mask in _blocks(rank, src, cp, c, ctx.documents):
                dq_b, dk_b, dv_b = _block_backward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], do[:, :, qs], out[:, :, qs],
                                                   lse[:, :, qs], delta[:, :, qs], scale, causal, mask)
                dq[:, :, qs] += dq_b
                part[0][:, :, ks] += dk_b
                part[1][:, :, ks] += dv_b
            if rep > 1:  # the repeats' gradients back onto the key/value heads
                part = part.view(2, b, h_kv, rep, t, d).sum(3)
            _wait(dkv_handles)
            if dkv is not None:
                part += dkv
            if cp == 1:  # already home
                dkv = part
                continue
            dkv = torch.empty_like(part)
            dkv_handles = _exchange(comm, part, dkv)  # on to the next rank; after cp sends, home
            _wait(handles)
            kv = nxt
        _wait(dkv_handles)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: GroupComm,
                   documents: RingDocuments | None = None) -> torch.Tensor:
    """Causal attention of this rank's ``q [B, H, t, D]`` over every rank's ``k, v [B, H_kv, t, D]``,
    tokens in the ring layout (:func:`positions`); returns ``[B, H, t, D]``. With ``documents``, within each
    packed document (:class:`RingDocuments`)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two equal chunks per rank; got {q.shape[2]} local tokens")
    return _RingAttention.apply(q, k, v, comm, documents)


# ---- all-to-all attention ----------------------------------------------------------------------

def kv_repeats(n_heads: int, kv_heads: int, cp: int) -> int:
    """How often the all-to-all mode repeats each key/value head so that ``cp`` divides them and each
    copy serves whole query heads: ``cp / gcd(kv_heads, cp)`` (1 when ``cp`` divides ``kv_heads``)."""
    f = cp // math.gcd(kv_heads, cp)
    if (n_heads // kv_heads) % f:
        raise ValueError(f"{n_heads} query heads on {kv_heads} key/value heads cannot be split over {cp} ranks")
    return f


def layer_bytes(mode: str, cp: int, b: int, h: int, h_kv: int, t: int, d: int, e: int = 4
                ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """``(forward, backward)``, each ``{op: (calls, bytes)}``: one rank's context-parallel messages in one layer (the
    module docstring's formulas), for ``b`` rows of ``t = T / cp`` local tokens, ``h`` query and ``h_kv`` key/value
    heads (of this tensor-parallel rank) of size ``d``, ``e`` bytes per element. ``bytes`` is what the rank's
    tensors hold (the ledger's ``bytes``); on the wire a send moves all of it, an all-to-all ``(cp - 1) / cp``.

    Ring (sends; a key/value block is ``2 b h_kv t d e``): forward ``cp - 1`` blocks; backward ``cp - 1`` blocks
    and ``cp`` fp32 gradient blocks (``2 b h_kv t d 4``), ``2 cp - 1`` sends. Ulysses (all-to-alls): four each way
    (q, k, v, out) holding ``b t d e (2 h + 2 f h_kv)`` together, ``f`` = :func:`kv_repeats`."""
    if cp <= 1:
        return {}, {}
    if mode == "ring":
        block = 2 * b * h_kv * t * d
        return ({"send": (cp - 1, (cp - 1) * block * e)},
                {"send": (2 * cp - 1, (cp - 1) * block * e + cp * block * 4)})
    f = kv_repeats(h, h_kv, cp)
    each = {"all_to_all": (4, b * t * d * e * (2 * h + 2 * f * h_kv))}
    return each, dict(each)


def ulysses_attention(q, k, v, comm: GroupComm, attend) -> torch.Tensor:
    """All-to-all attention: ``q [B, H, t, D]``, ``k, v [B, H_kv, t, D]`` in (contiguous sequence shards),
    ``attend(q, k, v)`` on whole sequences of ``H / cp`` heads, ``[B, H, t, D]`` out."""
    cp = comm.size
    if q.shape[1] % cp:
        raise ValueError(f"all-to-all attention splits the {q.shape[1]} query heads over {cp} ranks; they must divide")
    f = kv_repeats(q.shape[1], k.shape[1], cp)
    k, v = _expand(k, f), _expand(v, f)
    # the all-to-all packs its chunks from any strides (one copy in, one out), so the projections' transposed
    # views go in as they are; the output comes back laid out [B, t, H, D], as ``o_proj`` takes it
    q, k, v = (all_to_all(x, comm, scatter_dim=1, gather_dim=2) for x in (q, k, v))
    out = attend(q, k, v).transpose(1, 2)
    return all_to_all(out, comm, scatter_dim=1, gather_dim=2).transpose(1, 2)


# ---- packed documents ----------------------------------------------------------------------------

class ContextDocumentMask:
    """Packed documents (``data.document_mask``) on a context-parallel rank, in place of the model's
    :class:`~trickles.models.documents.DocumentMask`: ``documents [B, T]`` are the whole sequence's ids (every rank
    holds them; the trainer does not cut them). :attr:`positions` are this rank's tokens' positions within their
    documents; :meth:`attend` runs the ring with :class:`RingDocuments`' block masks, or the all-to-all with the
    whole sequence's mask on every rank after the exchange."""

    def __init__(self, documents: torch.Tensor, device: torch.device, ctx: CPContext):
        self.host, self.ctx = documents, ctx
        self.ids = documents.to(device, non_blocking=True)
        self.positions = document_positions(self.ids)[:, ctx.positions(device)]
        self._ring = RingDocuments(documents, self.ids) if ctx.mode == "ring" else None
        self._whole = DocumentMask(documents, device=device) if ctx.mode == "ulysses" else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        if dropout_p:
            raise ValueError("attention dropout does not run split over context-parallel ranks; set model.dropout=0")
        if self._ring is not None:
            return ring_attention(q, k, v, self.ctx.comm, self._ring)
        return ulysses_attention(q, k, v, self.ctx.comm, self._whole.attend)


# ---- applying it to a model --------------------------------------------------------------------

def apply_context_parallel(model: Transformer, comm: GroupComm, mode: str) -> CPContext:
    """Makes ``model`` (in place) run on this rank's tokens of every sequence: attention over the ring or
    all-to-all, positions looked up globally. The parameters are untouched (replicated over cp)."""
    ctx = CPContext(comm, mode)
    for block in model.layers.values():
        attn = block.attn
        plain = attn._attend  # the model's own attention (SDPA), used when not split and by all-to-all

        def attend(q, k, v, causal_offset, plain=plain):
            if not ctx.active or causal_offset is not None:
                return plain(q, k, v, causal_offset)
            if mode == "ring":
                return ring_attention(q, k, v, ctx.comm)
            return ulysses_attention(q, k, v, ctx.comm, lambda q_, k_, v_: plain(q_, k_, v_, None))
        # instance attribute shadowing the method; ``core`` (and what wraps it) calls ``self._attend``
        object.__setattr__(attn, "_attend", attend)
        if block.moe:  # per-sequence routing rules completed over the cp ranks
            split_sequence(block.mlp, comm, mode, lambda: ctx.active)

    if model.pos_embed is not None:
        # before any other hook (sequence parallel then keeps its part of these positions); per-row positions
        # (packed documents: ContextDocumentMask.positions) are this rank's already
        model.pos_embed.register_forward_pre_hook(
            lambda module, args: (ctx.positions(args[0].device),) if ctx.active and args[0].dim() == 1 else None,
            prepend=True)
    rope = model.rope

    def global_rope(start: int, length: int, positions: torch.Tensor | None = None):
        if positions is not None:  # packed documents: this rank's tokens' positions within their documents
            return rope(start, length, positions)
        if not ctx.active or model.rope_cos is None:
            return rope(start, length)
        pos = ctx.positions(model.rope_cos.device)
        return model.rope_cos[pos], model.rope_sin[pos]
    object.__setattr__(model, "rope", global_rope)
    document_mask = model.document_mask

    def split_documents(documents: torch.Tensor, device: torch.device):
        return ContextDocumentMask(documents, device, ctx) if ctx.active else document_mask(documents, device)
    object.__setattr__(model, "document_mask", split_documents)

    def switch(module, args, kwargs):
        tokens = args[0] if args else kwargs["tokens"]
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        ctx.begin_forward(tokens.shape[1], decoding=cache is not None)
    model.register_forward_pre_hook(switch, with_kwargs=True, prepend=True)
    return ctx
