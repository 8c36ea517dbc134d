"""Context parallelism: every sequence split over the ``cp`` ranks, attention exchanged between them.

Weights are replicated over the ``cp`` ranks exactly like data parallelism: each cp rank runs the
whole model on its ``T / cp`` tokens of every sequence, the loss is its mean over those tokens, and
the gradients are averaged over the combined ``dp x cp`` group (every rank holds the same number of
tokens, so the average of the per-rank means is the mean over the global batch). Everything except
attention is per token; attention needs the other ranks' keys and values. Two ways:

**Ring** (``parallel.cp_mode = "ring"``): the load-balanced ring of key/value blocks, its exact merge, its
backward and bytes are :mod:`trickles.parallel.ring`'s; it takes each layer's sliding window (skipping the blocks
wholly outside it, :mod:`trickles.parallel.ring_plan`), scale and soft cap.

**All-to-all** (``parallel.cp_mode = "ulysses"``). Rank ``i`` holds the contiguous positions
``[i t, (i+1) t)``. Before attention one all-to-all per tensor trades sequence shards for head
shards -- ``q [B, H, t, D] -> [B, H / cp, T, D]``, likewise ``k`` and ``v`` -- attention runs on
whole sequences for ``H / cp`` heads (the model's own attention, causal, with the layer's sliding window, scale and
soft cap; packed documents' mask on the whole sequence), and one all-to-all trades
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
from .ring import RingDocuments, repeat_heads, ring_attention  # noqa: F401 (ring_attention re-exported)
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
            self._positions[key] = positions(
                self.local_len * self.comm.size, self.comm.size, self.comm.rank, self.mode
            ).to(device)
        return self._positions[key]


# ---- all-to-all attention ----------------------------------------------------------------------


def kv_repeats(n_heads: int, kv_heads: int, cp: int) -> int:
    """How often the all-to-all mode repeats each key/value head so that ``cp`` divides them and each
    copy serves whole query heads: ``cp / gcd(kv_heads, cp)`` (1 when ``cp`` divides ``kv_heads``)."""
    f = cp // math.gcd(kv_heads, cp)
    if (n_heads // kv_heads) % f:
        raise ValueError(f"{n_heads} query heads on {kv_heads} key/value heads cannot be split over {cp} ranks")
    return f


def layer_bytes(
    mode: str, cp: int, b: int, h: int, h_kv: int, t: int, d: int, e: int = 4, dv: int | None = None
) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """``(forward, backward)``, each ``{op: (calls, bytes)}``: one rank's context-parallel messages in one layer (the
    module docstring's formulas), for ``b`` rows of ``t = T / cp`` local tokens, ``h`` query and ``h_kv`` key/value
    heads (of this tensor-parallel rank) of size ``d``, ``e`` bytes per element. ``bytes`` is what the rank's
    tensors hold (the ledger's ``bytes``); on the wire a send moves all of it, an all-to-all ``(cp - 1) / cp``.

    Ring (sends; a key/value block is ``2 b h_kv t d e``): forward ``cp - 1`` blocks; backward ``cp - 1`` blocks
    and ``cp`` fp32 gradient blocks (``2 b h_kv t d 4``), ``2 cp - 1`` sends. Ulysses (all-to-alls): four each way
    (q, k, v, out) holding ``b t d e (2 h + 2 f h_kv)`` together, ``f`` = :func:`kv_repeats`.

    ``dv``: the values' (and output's) size where it differs from the keys' ``d`` (latent attention): the ring
    pads values to ``d`` (the same bytes as above); Ulysses sends ``b t e (h + f h_kv) (d + dv)``."""
    if cp <= 1:
        return {}, {}
    if mode == "ring":
        block = 2 * b * h_kv * t * d
        return ({"send": (cp - 1, (cp - 1) * block * e)}, {"send": (2 * cp - 1, (cp - 1) * block * e + cp * block * 4)})
    f = kv_repeats(h, h_kv, cp)
    each = {"all_to_all": (4, b * t * e * (h + f * h_kv) * (d + (d if dv is None else dv)))}
    return each, dict(each)


def ulysses_attention(q, k, v, comm: GroupComm, attend) -> torch.Tensor:
    """All-to-all attention: ``q [B, H, t, D]``, ``k, v [B, H_kv, t, D]`` in (contiguous sequence shards),
    ``attend(q, k, v)`` on whole sequences of ``H / cp`` heads, ``[B, H, t, D]`` out."""
    cp = comm.size
    if q.shape[1] % cp:
        raise ValueError(f"all-to-all attention splits the {q.shape[1]} query heads over {cp} ranks; they must divide")
    f = kv_repeats(q.shape[1], k.shape[1], cp)
    k, v = repeat_heads(k, f), repeat_heads(v, f)
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
        self._ring = self._whole = None
        if ctx.mode == "ulysses":  # the whole sequence's mask (and the ids on the device, and their positions)
            self._whole = DocumentMask(documents, device=device)
            whole = self._whole.positions
        else:
            self._ring = RingDocuments(documents, documents.to(device, non_blocking=True))
            whole = document_positions(self._ring.ids)
        self.positions = whole[:, ctx.positions(device)]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """As :meth:`~trickles.models.documents.DocumentMask.attend` on the whole sequence: within documents, with
        ``window`` a query at ``i`` sees keys ``i - window < j`` only, scores scaled by ``scale`` and soft-capped at
        ``softcap`` where given."""
        if dropout_p:
            raise ValueError("attention dropout does not run split over context-parallel ranks; set model.dropout=0")
        if self._ring is not None:
            return ring_attention(q, k, v, self.ctx.comm, self._ring, window, scale, softcap)
        given = {n: x for n, x in (("window", window), ("scale", scale), ("softcap", softcap)) if x is not None}
        return ulysses_attention(q, k, v, self.ctx.comm, lambda q_, k_, v_: self._whole.attend(q_, k_, v_, **given))


# ---- applying it to a model --------------------------------------------------------------------


def apply_context_parallel(model: Transformer, comm: GroupComm, mode: str) -> CPContext:
    """Makes ``model`` (in place) run on this rank's tokens of every sequence: attention over the ring or
    all-to-all, positions looked up globally. The parameters are untouched (replicated over cp)."""
    ctx = CPContext(comm, mode)
    for block in model.layers.values():
        attn = block.attn
        plain = attn._attend  # the model's own attention (SDPA), used when not split and by all-to-all

        def attend(q, k, v, causal_offset, plain=plain, attn=attn):
            if not ctx.active or causal_offset is not None:
                return plain(q, k, v, causal_offset)
            if mode == "ring":  # the layer's window, scale and soft cap (absent attributes: none of them)
                return ring_attention(
                    q, k, v, ctx.comm, None, attn.window, getattr(attn, "scale", None), getattr(attn, "softcap", None)
                )
            # the model's own attention on whole sequences applies the layer's window, scale and soft cap itself
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
            prepend=True,
        )
    rope = model.rope

    def global_rope(start: int, length: int, positions: torch.Tensor | None = None):
        if positions is not None:  # packed documents: this rank's tokens' positions within their documents
            return rope(start, length, positions)
        if not ctx.active or model.rope_cos is None:
            return rope(start, length)
        pos = ctx.positions(model.rope_cos.device)
        model.ensure_rope(model.cfg.max_seq_len)  # (rows named by a tensor: every row, filled once)
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
