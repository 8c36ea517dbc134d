"""Which blocks ring attention (:mod:`trickles.parallel.ring`) computes, and with what mask: the causal chunks, a
sliding window, packed documents.

The sequence is cut into ``2 cp`` chunks of ``c`` tokens, rank ``i`` holding chunks ``i`` and ``2 cp - 1 - i``
(:func:`chunk_ids`). Query chunk ``a`` against key chunk ``b``: ``b > a`` lies above the diagonal and is never
computed; ``b < a`` is a full block, ``b = a`` the causal triangle.

**Sliding window** (``model.sliding_window = w`` on a layer, :func:`~trickles.models.masks.window_mask`: query ``q``
sees key ``k`` iff ``q - w < k <= q``). A block whose last key lies below the first query's window (``(b + 1) c <= a
c - w + 1``) is **skipped**: not computed, not masked. A block below the diagonal whose first key is inside the last
query's window (``b c >= a c + c - w``) runs whole, unmasked. Any other block -- the diagonal, or one the window's
edge crosses -- is cut into its four quarters, each of them treated the same way (skipped, whole, or cut again),
down to pieces of :func:`slab_rows` rows (``min(c, w) / 8``, at least :data:`SLAB_MIN`): such a piece runs causal
where it sits on the diagonal and the window does not reach into it, else with the band's mask over just the keys
some of its queries see. So the large pieces run unmasked and only a thin strip along the diagonal and along the
window's edge is masked; on a CPU, whose fused kernel computes a causal block's every score, the diagonal costs
about ``9/16`` of a block instead of one (on other devices, whose kernels skip the scores above a causal block's
diagonal themselves, a diagonal block the window does not reach into runs whole). For ``w = c`` (a quarter of the
sequence at cp=2) the block below the diagonal, where each query sees the keys right of its own column only, costs
about ``9/16`` of a block too, and the ones below it are skipped: a rank computes two diagonal blocks and at most
two such bands.

**Packed documents** (:class:`RingDocuments`, ``data.document_mask``). Every piece above pairs tokens
of one document only where some row's id ranges meet; where none does it is skipped; where every row's queries and
keys lie in one document it runs with the window's mask alone; otherwise with the same-document mask too. The
decisions are read from the host ids, so the device is never waited for.

**What travels** (:func:`route`). Without a window every key/value block goes round the whole ring (forward
``cp - 1`` sends; backward ``cp - 1`` sends of blocks and ``cp`` of their fp32 gradients, each starting at the
block's owner and summed on by every rank it passes). With a window a message carries only the chunks of its block
(:func:`seen_chunks`) that some rank further on sees, and none when no rank does; a block's gradient starts at the
first rank after its owner that sees it, carries the chunks seen so far, and its owner keeps its own part until the
sum comes home. So at cp=2 with ``w <= c`` each rank sends one chunk of keys and values forward and one of keys and
values and one of their gradients backward, ``B H_kv c D (2 e + 2 e + 8)`` bytes, against
``B H_kv c D (4 e + 4 e + 32)`` without the window. Which chunks travel is read from the window alone (packed
documents may leave a travelling chunk unused). In this layout a rank's high chunk ``2 cp - 1 - i`` sits next to its
successor's (``2 cp - 2 - i``), whose block reaches it only at the ring's last step, so the ring cannot stop early;
a chunk relayed by ranks that skip it still passes through them (sending each chunk straight to the ranks whose
windows reach it, both ways round, would move about ``1.5 m`` blocks for a window over ``m`` chunks instead of
``cp - 1``, fewer once ``cp - 1 > 1.5 m``; not built).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from .ring_blocks import BlockMask

SLAB_PARTS = 8  # the smallest pieces a block is cut into have about ``min(c, window) / SLAB_PARTS`` rows ...
SLAB_MIN = 16  # ... and at least this many (each piece is one kernel call)


Chunks = tuple[bool, bool]  # which of a rank's two chunks (its low, then its high one) a message or a buffer holds
BOTH, NONE = (True, True), (False, False)


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks of the sequence rank ``rank`` of ``cp`` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def seen_chunks(q_rank: int, kv_rank: int, cp: int, c: int, window: int | None) -> Chunks:
    """Which of ``kv_rank``'s chunks some query of ``q_rank`` sees: a chunk at or below a query chunk and not wholly
    below its first query's window (module doc; packed documents may skip more, never less)."""
    return tuple(
        any(b <= a and (window is None or (b + 1) * c - 1 > a * c - window) for a in chunk_ids(q_rank, cp))
        for b in chunk_ids(kv_rank, cp)
    )


def _either(chunks) -> Chunks:
    return tuple(any(x) for x in zip(*chunks, NONE))


class Route(NamedTuple):
    """What travels for one rank (module doc), per ring step ``s`` and the block of rank ``rank - s`` it holds then."""

    held: tuple[Chunks, ...]  # the block's chunks held at step s (s = 0: this rank's own, whole)
    seen: tuple[Chunks, ...]  # the block's chunks this rank's queries see (its gradient part at step s)
    sent: tuple[Chunks, ...]  # the block's chunks sent on at step s < cp - 1 (what the next rank holds at s + 1)
    grad_sent: tuple[Chunks, ...]  # the chunks of the block's gradient, summed so far, sent on at step s
    grad_recv: tuple[Chunks, ...]  # the chunks of the previous rank's gradient message received at step s
    keep_home: bool  # the rank keeps its own block's gradient part until the others' parts come home


@lru_cache(maxsize=256)
def route(rank: int, cp: int, c: int, window: int | None) -> Route:
    """The rank's :class:`Route` (module doc, "What travels"): with a window, a block's chunks travel while some rank
    further on sees them, and its gradient's chunks from the first rank after the owner that sees them; without one,
    every block and its gradient go whole (from the owner) round the ring."""
    if window is not None and window >= 2 * cp * c:
        window = None
    first = 0 if window is None and cp > 1 else 1  # the first step whose part starts a block's gradient message

    def seen(s: int, j: int) -> Chunks:  # rank j + s's view of block j
        return BOTH if window is None else seen_chunks((j + s) % cp, j % cp, cp, c, window)

    def ahead(j: int, s: int) -> Chunks:  # what block j's message sent at step s carries: seen further on
        return _either(seen(u, j) for u in range(s + 1, cp))

    def behind(j: int, s: int) -> Chunks:  # what block j's gradient holds after step s
        return _either(seen(u, j) for u in range(first, s + 1))

    steps = range(cp)
    return Route(
        held=tuple(BOTH if s == 0 else ahead(rank - s, s - 1) for s in steps),
        seen=tuple(seen(s, rank - s) for s in steps),
        sent=tuple(ahead(rank - s, s) for s in range(cp - 1)),
        grad_sent=tuple(behind(rank - s, s) for s in steps),
        grad_recv=tuple(behind(rank - 1 - s, s) for s in steps),
        keep_home=first == 1,
    )


def slab_rows(c: int, window: int | None) -> int:
    """The side of the smallest piece a ``c x c`` block is cut into (module doc)."""
    return min(c, max(SLAB_MIN, -(-min(c, window or c) // SLAB_PARTS)))


def window_pieces(q0: int, k0: int, c: int, window: int | None, cut_diagonal: bool = True):
    """``(i0, i1, j0, j1, kind)`` for the ``c x c`` block of queries at positions ``q0..q0+c`` against keys at
    ``k0..k0+c`` (``k0 <= q0``): local query rows ``[i0, i1)`` attend to local keys ``[j0, j1)``, ``kind`` ``"full"``
    (every pair seen), ``"causal"`` (row ``i0 + r`` sees keys ``j0 .. j0 + r``) or ``"band"`` (a mask). Nothing for
    a block wholly outside the window; one full piece for a block wholly inside it; else its quarters, each cut the
    same way down to :func:`slab_rows` (module doc). ``cut_diagonal`` false: a diagonal block the window does not
    reach into runs whole, causal (for a kernel that skips the scores above the diagonal itself)."""
    w = window or q0 + c + 1  # no window: longer than any distance here
    yield from _quarters(q0, k0, 0, c, 0, c, w, slab_rows(c, window), cut_diagonal)


def _quarters(q0, k0, i0, i1, j0, j1, w, s, cut_diagonal):
    first, last, kf, kl = q0 + i0, q0 + i1 - 1, k0 + j0, k0 + j1 - 1  # first and last query and key
    if kf > last or kl <= first - w:  # above the diagonal, or below the first query's window
        return
    if kl <= first and kf > last - w:  # every query sees every key
        yield i0, i1, j0, j1, "full"
    elif kf == first and kl == last and kf > last - w and (i1 - i0 <= s or not cut_diagonal):  # the diagonal
        yield i0, i1, j0, j1, "causal"
    elif i1 - i0 <= s or j1 - j0 <= s:  # small enough: the keys some query sees, masked
        lo, hi = max(kf, first - w + 1), min(kl, last)
        yield i0, i1, lo - k0, hi + 1 - k0, "band"
    else:
        im, jm = (i0 + i1) // 2, (j0 + j1) // 2
        for a, b in ((i0, im), (im, i1)):
            for c, d in ((j0, jm), (jm, j1)):
                yield from _quarters(q0, k0, a, b, c, d, w, s, cut_diagonal)


def band(q_first: int, k_first: int, rows: int, cols: int, window: int, device) -> torch.Tensor:
    """``[rows, cols]`` boolean: query at ``q_first + r`` sees key at ``k_first + j`` (causal, within ``window``)."""
    q = torch.arange(q_first, q_first + rows, device=device)[:, None]
    k = torch.arange(k_first, k_first + cols, device=device)[None, :]
    return (k <= q) & (k > q - window)


def _band_mask(delta: int, rows: int, cols: int, window: int, device: str) -> BlockMask:
    return BlockMask(band(delta, 0, rows, cols, window, device)[None, None])


def _pieces(q_rank: int, kv_rank: int, cp: int, c: int, window: int | None, cut_diagonal: bool):
    """``(q slice, kv slice, kind, first query position, first key position)`` of every piece of ``q_rank``'s
    queries against ``kv_rank``'s keys that is computed (local offsets)."""
    for qa, a in enumerate(chunk_ids(q_rank, cp)):
        for kb, b in enumerate(chunk_ids(kv_rank, cp)):
            if b > a:
                continue
            for i0, i1, j0, j1, kind in window_pieces(a * c, b * c, c, window, cut_diagonal):
                qs, ks = slice(qa * c + i0, qa * c + i1), slice(kb * c + j0, kb * c + j1)
                yield qs, ks, kind, a * c + i0, b * c + j0


def plain_blocks(
    q_rank: int, kv_rank: int, cp: int, c: int, window: int | None, device, masks: dict | None = None
) -> list:
    """``(q slice, kv slice, causal, mask or None)`` of the blocks to compute without documents (module doc). The
    pieces are planned once per shape (cached); their band masks are built by the caller's call, one per distinct
    ``(offset, rows, cols)`` (kept in ``masks`` when given, shared by the steps of one layer call), so no device
    tensor outlives the layer call that uses it."""
    if window is not None and window >= 2 * cp * c:
        window = None  # a window as long as the sequence cuts nothing
    device, masks = str(device), {} if masks is None else masks
    out = []
    for qs, ks, kind, delta in _plan(q_rank, kv_rank, cp, c, window, device.startswith("cpu")):
        mask = None
        if kind == "band":
            key = (delta, qs.stop - qs.start, ks.stop - ks.start)
            if key not in masks:
                masks[key] = _band_mask(*key, window, device)
            mask = masks[key]
        out.append((qs, ks, kind == "causal", mask))
    return out


@lru_cache(maxsize=256)
def _plan(q_rank, kv_rank, cp, c, window, cut_diagonal) -> tuple:
    return tuple(
        (qs, ks, kind, q0 - k0) for qs, ks, kind, q0, k0 in _pieces(q_rank, kv_rank, cp, c, window, cut_diagonal)
    )


class RingDocuments:
    """Packed documents' masks for the ring's blocks (``data.document_mask``): every rank holds the whole
    sequence's document ids ``[B, T]`` -- on the host (:attr:`host`, where the loader made them) and on the device.

    A piece of queries ``[q0, q1)`` against keys ``[k0, k1)`` (a block, or a window's slab: module doc) pairs
    tokens of one document only where some row's ids meet (the ids never decrease along a row); where no row's do
    the piece is **skipped** (its keys and values still travel on). Where every row's queries and keys lie in one
    document it runs as without documents; otherwise with the mask ``doc_q == doc_k`` (and the causal triangle or
    the window's band), built once per forward and reused by backward
    (:class:`~trickles.parallel.ring_blocks.BlockMask`, which each block kernel takes in its own form). All
    decisions are read from the host ids: the device is never waited for."""

    def __init__(self, host: torch.Tensor, device_ids: torch.Tensor):
        self.host, self.ids = host, device_ids
        self._blocks: dict[tuple, list] = {}

    def blocks(self, q_rank: int, kv_rank: int, cp: int, c: int, window: int | None = None) -> list:
        """``(q slice, kv slice, causal, mask or None)`` of the pieces to compute (class doc)."""
        if window is not None and window >= 2 * cp * c:
            window = None
        key = (q_rank, kv_rank, c, window)
        if key not in self._blocks:
            self._blocks[key] = [
                block
                for qs, ks, kind, q0, k0 in _pieces(q_rank, kv_rank, cp, c, window, self.ids.device.type == "cpu")
                if (block := self._piece(qs, ks, kind, q0, k0, window)) is not None
            ]
        return self._blocks[key]

    def _piece(self, qs, ks, kind, q0, k0, window):
        rows, cols = qs.stop - qs.start, ks.stop - ks.start
        hq, hk = self.host[:, q0 : q0 + rows], self.host[:, k0 : k0 + cols]
        if kind == "band":
            seen = band(q0, k0, rows, cols, window, "cpu") & (hq[:, :, None] == hk[:, None, :])
            if not bool(seen.any()):
                return None  # no row pairs a query with a key of its document inside the window
        elif kind == "full" and not bool((hk[:, -1] == hq[:, 0]).any()):
            return None  # every key precedes every query: no row pairs a query with a key of its document
        if bool((hk[:, 0] == hq[:, -1]).all()):  # one document throughout, in every row
            return (
                qs,
                ks,
                kind == "causal",
                None if kind != "band" else _band_mask(q0 - k0, rows, cols, window, str(self.ids.device)),
            )
        dq, dk = self.ids[:, q0 : q0 + rows], self.ids[:, k0 : k0 + cols]
        mask = dq[:, None, :, None] == dk[:, None, None, :]
        if kind == "causal":
            mask = mask & torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril()
        elif kind == "band":
            mask = mask & band(q0, k0, rows, cols, window, mask.device)
        return qs, ks, False, BlockMask(mask)
