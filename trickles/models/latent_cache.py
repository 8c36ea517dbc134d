"""The decoding cache of multi-head latent attention (:mod:`trickles.models.mla`): per layer one ``[B, max_len,
kv_lora_rank + qk_rope_head_dim]`` table of each token's compressed key/value latent (after its norm) and its rotary
key (rotated, shared by the heads), so ``(kv_lora_rank + qk_rope_head_dim) x dtype`` bytes a token per layer.

It is the dense :class:`~trickles.models.kv_cache.KVCache`'s interface (``update``, ``reorder``, ``end``, the
per-layer tables in ``k``): the rows are the keys of the absorbed decode path, and its values are their first
``kv_lora_rank`` columns, so ``v`` stays empty.
"""

from __future__ import annotations

import torch


class LatentCache:
    """Pre-allocated latent rows ``[B, max_len, width]`` per layer (``width = kv_lora_rank + qk_rope_head_dim``)."""

    def __init__(self, n_layers: int, batch: int, max_len: int, width: int, dtype, device):
        self.shape = (batch, max_len, width)
        self.dtype, self.device = dtype, device
        self.k: dict[int, torch.Tensor] = {}  # a layer's table appears on its first update
        self.v: dict[int, torch.Tensor] = {}  # empty: the values are the latent columns of ``k``
        self.n_layers = n_layers
        self.max_len = max_len
        self.end = 0  # positions written so far (the longest prefix any update reached)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer: ``width x`` the element size."""
        return self.shape[2] * torch.empty((), dtype=self.dtype).element_size()

    def update(self, layer: int, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Writes ``rows [B, T, width]`` at positions ``start..start+T`` and returns every row so far."""
        end = start + rows.shape[1]
        if end > self.max_len:
            raise ValueError(f"latent cache holds {self.max_len} positions; generation reached {end}")
        if layer not in self.k:
            self.k[layer] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.k[layer][:, start:end] = rows
        self.end = max(self.end, end)
        return self.k[layer][:, :end]

    @torch.no_grad()
    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes what row ``index[i]`` was (beam search), in place, only the rows that change."""
        index = index.to(device=self.device, dtype=torch.long)
        rows = torch.nonzero(index != torch.arange(len(index), device=self.device)).flatten()
        if rows.numel() == 0:
            return
        src = index[rows]
        for table in self.k.values():
            written = table[:, : self.end]
            written.index_copy_(0, rows, written.index_select(0, src))
