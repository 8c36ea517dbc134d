"""Packed documents: attention that never crosses a document boundary, and positions that restart per document.

Training sequences are cut from one stream of documents, each followed by end-of-text (eos), so a sequence holds the
tail of one document and the heads of the next ones. With ``data.document_mask = true`` the data loader gives every
token a **document id** (:func:`document_ids`, ``[B, T]`` int32, non-decreasing along a row) and the model

* attends from query ``i`` to key ``j`` only where ``j <= i`` and ``doc[j] == doc[i]`` (:class:`DocumentMask`), and
* embeds token ``i`` at its position **within its document** (:func:`document_positions`): rotary tables (llama) and
  learned positions (gpt2) both restart at 0 at every document.

**Where a boundary falls.** The eos token *opens* the next document: ``doc[i]`` counts the eos tokens at positions
``0..i`` inclusive, so a document is ``[eos, t1, ..., tn]`` at positions ``0..n``. The loss at each document's first
token ``t1`` is its prediction from that eos alone -- the document's own end-of-text predecessor, as an empty
prompt (``generate`` starts it from eos) asks the model at inference -- and ``tn`` predicts the next eos, the end of
its document, from its document alone. Every position's prediction then depends on its own document only, which is
what makes a packed document's losses and gradients equal the document's run by itself. (The other convention, eos
closing its document, would predict each document's first token from the whole previous document: a prediction
that depends on an unrelated text.) A sequence's leading piece, the tail of a document cut by the window, is a
document starting at position 0.

**How attention runs.** :meth:`DocumentMask.attend` picks, once per forward:

* ``flex`` -- ``torch.nn.attention.flex_attention`` (compiled) with a block mask built from the ids: blocks of
  ``128 x 128`` that no pair of the same document reaches are skipped, the others are masked element-wise. Where
  it has a backward (CUDA), this is the path.
* ``dense`` -- scaled dot-product attention with a boolean ``[B, 1, T, T]`` mask built from the ids inside the forward
  (nothing per sequence is stored beforehand). PyTorch's CPU flash kernel takes the mask; this is the CPU path.

A layer with a sliding window (``model.sliding_window``) adds ``i - window < j`` to either mask (a second block
mask, built once per forward and window, on the flex path).

Both take the layer's score scale (``model.query_pre_attn_scalar``) and soft cap (``model.attn_softcap``): flex as
its ``scale`` and a ``score_mod`` capping each score, the dense path through
:func:`~trickles.models.masks.capped_attention` with the mask when capped.

Both give the attention of :func:`reference_attention` (the test's hand-written one). The plain causal case (no
ids) never comes here: it keeps SDPA's ``is_causal`` path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .masks import capped_attention

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # torch < 2.5: the dense path only
    create_block_mask = flex_attention = None

FLEX_BLOCK = 128  # flex attention's block size along queries and keys


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, T]`` int32 document ids of a packed batch: the count of eos tokens at or before each position."""
    return torch.cumsum(tokens == eos_id, dim=1, dtype=torch.int32)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: each token's position within its document (0 where its id first appears in the row)."""
    t = documents.shape[1]
    index = torch.arange(t, device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    start = torch.cummax(torch.where(first, index, torch.zeros_like(index)), dim=1).values
    return index - start


def dense_mask(documents: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` boolean: query ``i`` sees key ``j`` iff ``j <= i`` and both are in the same document."""
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


def flex_available(device: torch.device) -> bool:
    """Whether flex attention can train here: it exists (torch >= 2.5) and has a backward on ``device``."""
    return device.type == "cuda" and flex_attention is not None


_COMPILED: dict[str, object] = {}
_CAPS: dict[float, object] = {}  # flex score_mods by soft cap, made once each (a new function would recompile)


def _cap_scores(softcap: float):
    """flex attention's ``score_mod`` turning a (scaled) score into ``softcap * tanh(score / softcap)``."""
    if softcap not in _CAPS:

        def cap(score, b, h, q, k):
            return torch.tanh(score / softcap) * softcap

        _CAPS[softcap] = cap
    return _CAPS[softcap]


def _compiled_flex():
    """flex attention compiled once per process (uncompiled it materializes every score)."""
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def block_mask(documents: torch.Tensor, window: int | None = None):
    """flex attention's ``BlockMask`` for ``documents [B, T]`` (same document and causal, and with ``window`` only
    ``q - window < k``), heads broadcast."""

    def same_document_causal(b, h, q, k):
        seen = (documents[b, q] == documents[b, k]) & (k <= q)
        return seen if window is None else seen & (k > q - window)

    b, t = documents.shape
    return create_block_mask(
        same_document_causal, b, None, t, t, device=documents.device, BLOCK_SIZE=min(FLEX_BLOCK, t)
    )


class DocumentMask:
    """The attention mask of one packed micro-batch, built once per forward and shared by every layer.

    ``documents [B, T]``: the ids (:func:`document_ids`), on the host where the loader made them (:attr:`host`:
    what needs deciding from them is decided there, without waiting for the device) and copied to ``device``
    (:attr:`documents`); ``backend``: ``"flex"``, ``"dense"`` or ``"auto"`` (flex where :func:`flex_available`,
    else dense). :attr:`positions` are the tokens' positions in their documents, on ``device``."""

    def __init__(self, documents: torch.Tensor, backend: str = "auto", device: torch.device | None = None):
        if backend not in ("auto", "flex", "dense"):
            raise ValueError(f"backend must be auto, flex or dense, got {backend!r}")
        self.host = documents
        documents = documents.to(device if device is not None else documents.device, non_blocking=True)
        if backend == "auto":
            backend = "flex" if flex_available(documents.device) else "dense"
        self.documents, self.backend = documents, backend
        self.positions = document_positions(documents)
        self._mask = block_mask(documents) if backend == "flex" else dense_mask(documents)
        self._windowed: dict[int, object] = {}  # flex block masks with a sliding window, built on first use

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
        """``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]`` -> ``[B, H, T, D]``, within documents; with ``window`` a query
        at ``i`` sees only keys ``i - window < j`` as well (:func:`~trickles.models.masks.window_mask`). ``scale``:
        the scores' (none: ``1/sqrt(D)``); ``softcap``: scores capped to ``softcap * tanh(s / softcap)``."""
        rep = q.shape[1] // k.shape[1]
        t = q.shape[2]
        window = window if window is not None and window < t else None  # a window as long as the row cuts nothing
        if self.backend == "flex":
            if dropout_p:
                raise ValueError(
                    "flex attention has no dropout; set model.dropout=0 with data.document_mask=true on CUDA"
                )
            mask = self._mask
            if window is not None:
                if window not in self._windowed:
                    self._windowed[window] = block_mask(self.documents, window)
                mask = self._windowed[window]
            mod = None if softcap is None else _cap_scores(softcap)
            return _compiled_flex()(q, k, v, score_mod=mod, block_mask=mask, scale=scale, enable_gqa=rep > 1)
        mask = self._mask
        if window is not None:
            index = torch.arange(t, device=q.device)
            mask = mask & (index[None, :] > index[:, None] - window)
        if softcap is not None:
            return capped_attention(q, k, v, mask, scale, softcap, dropout_p)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """The plainest same-document causal attention (with ``window``: keys ``i - window < j`` only), fp32 scores and
    an explicit softmax (tests compare to it)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    mask = dense_mask(documents)
    if window is not None:
        index = torch.arange(q.shape[2], device=q.device)
        mask = mask & (index[None, :] > index[:, None] - window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)
