"""Which tokens of every sequence each of ``n`` ranks holds when the sequences are split over them.

Context parallelism (:mod:`trickles.parallel.context`) lays a sequence out in one of two ways, and the
mixture-of-experts blocks complete their per-sequence routing over the same layouts
(:func:`trickles.parallel.expert.split_sequence`, also under sequence parallelism):

* ``"ring"``: the sequence is cut into ``2 n`` chunks of ``c = T / (2 n)`` tokens and rank ``i`` holds chunks ``i``
  and ``2 n - 1 - i`` (so under the causal mask every rank has the same work);
* any other layout (``"ulysses"``, ``"contiguous"``): rank ``i`` holds the positions ``[i t, (i+1) t)``, ``t = T / n``.

:func:`positions` gives a rank's global positions in its local order; :func:`shard_sequence` cuts a batch to a
rank's tokens and :func:`unshard_sequence` puts every rank's parts back at their positions.
"""

from __future__ import annotations

import torch


def positions(seq_len: int, cp: int, rank: int, mode: str) -> torch.Tensor:
    """Global positions rank ``rank`` of ``cp`` holds of a ``seq_len`` sequence, in its local order."""
    if mode == "ring":
        c = seq_len // (2 * cp)
        j = 2 * cp - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(j * c, (j + 1) * c)])
    t = seq_len // cp
    return torch.arange(rank * t, (rank + 1) * t)


def shard_sequence(t: torch.Tensor, cp: int, rank: int, mode: str) -> torch.Tensor:
    """This rank's tokens of ``t [B, T, ...]`` (inputs or targets), in the layout of ``mode``."""
    if cp == 1:
        return t
    return t[:, positions(t.shape[1], cp, rank, mode)].contiguous()


def unshard_sequence(parts: list[torch.Tensor], mode: str) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank's ``[B, t, ...]`` (in rank order) -> ``[B, T, ...]``."""
    cp = len(parts)
    seq = parts[0].shape[1] * cp
    out = parts[0].new_empty((parts[0].shape[0], seq, *parts[0].shape[2:]))
    for r, p in enumerate(parts):
        out[:, positions(seq, cp, r, mode).to(out.device)] = p
    return out
