"""The dense key/value cache of incremental decoding: per layer one ``[B, H_kv, max_len, D]`` table each for keys
and values, written position by position as tokens are generated and reordered in place by beam search.

(The server's engine keeps its keys and values in a paged pool instead: :mod:`trickles.infer.paged`.)
"""

from __future__ import annotations

import torch


class KVCache:
    """Pre-allocated keys and values for incremental decoding, ``[B, H_kv, max_len, D]`` per layer."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        self.shape = (batch, n_kv_heads, max_len, head_dim)
        self.dtype, self.device = dtype, device
        self.k: dict[int, torch.Tensor] = {}  # a layer's tables appear on its first update (a model part
        self.v: dict[int, torch.Tensor] = {}  # holding some layers allocates only theirs)
        self.n_layers = n_layers
        self.max_len = max_len
        self.end = 0  # positions written so far (the longest prefix any update reached)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``k, v [B, H_kv, T, D]`` at positions ``start..start+T`` and returns everything so far."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; generation reached {end}")
        if layer not in self.k:
            self.k[layer] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.v[layer] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        self.end = max(self.end, end)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    @torch.no_grad()
    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes what row ``index[i]`` was (beam search), in place: only the rows that change are
        gathered (``index_select``) and written back into the same storage (``index_copy_``)."""
        index = index.to(device=self.device, dtype=torch.long)
        rows = torch.nonzero(index != torch.arange(len(index), device=self.device)).flatten()
        if rows.numel() == 0:
            return
        src = index[rows]
        for table in (*self.k.values(), *self.v.values()):
            written = table[:, :, : self.end]
            written.index_copy_(0, rows, written.index_select(0, src))
