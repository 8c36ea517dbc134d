"""A paged key/value cache: fixed-size blocks from one preallocated pool, a block table per sequence.

**The pool.** Per layer, keys and values are one tensor each, ``[H_kv, N * P, D]`` (head-major): ``N`` blocks of
``P`` positions (``block_size``). Position ``p`` of a sequence whose block table is ``[b_0, b_1, ...]`` lives in pool
slot ``b_{p // P} * P + p % P``. A sequence holds ``ceil(L / P)`` blocks for its ``L`` cached positions, so memory
follows the tokens actually held (at most ``P - 1`` positions wasted per sequence), and a finished sequence's
blocks go straight back to the free list. Bytes: ``2 * n_layers * N * P * H_kv * D * element_size``
(:func:`block_bytes` is one block of every layer). The pool starts zeroed, so a slot read but masked out never
holds NaN (a masked score times a NaN value would still be NaN).

**One model call over paged sequences** (:class:`PagedCall`). Row ``b`` has ``c_b`` positions cached and feeds
``n_b`` new tokens (a prefill chunk, or one token when decoding), ``T = max n_b``, right-aligned in the ``[B, T]``
tokens, each with its own position (``c_b ..``; a padding query sits at a cached position and its output is
discarded). In each layer :meth:`PagedCall.update` writes the real new keys and values into their pool slots (one
``index_copy_``) and gathers every row's positions ``0 .. S - 1`` (``S = max_b L_b``, slot ``s`` holding position
``s``) into one reused ``[H_kv, B, S, D]`` buffer (one ``index_select`` per layer), handed to the model as its
``[B, H_kv, S, D]`` view: the model's attention sees the heads lead and runs SDPA in that order, so no copy of the
keys is made (on a CPU, SDPA on keys strided the other way is about twice as slow, and a copy per layer into fresh
memory costs page faults). The attention mask ``[B, 1, T, S]`` lets the query at position ``q`` see slots
``s <= q``: causal, and never a slot past its row's end. The kernel sees a dense batch, the cache stays paged; the
gather moves ``2 B S H_kv D`` elements per layer, what attention reads anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError

__all__ = ["BlockPool", "PagedCall", "block_bytes", "kv_layout", "pool_blocks"]


def kv_layout(model) -> tuple[list[int], int, int, torch.dtype, torch.device]:
    """``(layer ids, key/value heads held, head dim, dtype, device)`` of ``model``'s cache (a tensor-parallel
    plan may hold a slice of the heads)."""
    attn = next(iter(model.layers.values())).attn
    head_dim = model.cfg.head_dim
    if attn.fused:
        kv_heads = attn.qkv_proj.out_features // ((attn.rep + 2) * head_dim)
    else:
        kv_heads = attn.k_proj.out_features // head_dim
    p = next(model.parameters())
    dtype = p.dtype if p.dtype.is_floating_point else torch.float32
    return [blk.attn.layer_id for blk in model.layers.values()], kv_heads, head_dim, dtype, p.device


def block_bytes(model, block_size: int) -> int:
    """Bytes of one block of every layer's keys and values."""
    layers, heads, dim, dtype, _ = kv_layout(model)
    return 2 * len(layers) * block_size * heads * dim * torch.empty((), dtype=dtype).element_size()


def pool_blocks(model, block_size: int, num_blocks: int, kv_bytes: int, sequences: int) -> int:
    """Blocks of a pool: ``num_blocks`` when given, else as many as ``kv_bytes`` hold, else room for ``sequences``
    full contexts of ``model``. ValueError for a byte budget that holds no block."""
    if num_blocks:
        return num_blocks
    if kv_bytes:
        if kv_bytes // block_bytes(model, block_size) < 1:
            raise ValueError(
                f"a KV pool of {kv_bytes} bytes holds no block of {block_size} positions "
                f"({block_bytes(model, block_size)} bytes each): give it more memory"
            )
        return kv_bytes // block_bytes(model, block_size)
    return sequences * -(-model.cfg.max_seq_len // block_size)


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions for every layer of ``model``, allocated once."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, device=None):
        window, context = model.cfg.sliding_window, model.cfg.max_seq_len
        if window is not None and (context is None or window < context):
            raise ConfigError(
                f"the paged serving engine does not build sliding windows yet (model.sliding_window={window}); "
                "use trickles generate"
            )
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a KV pool needs at least one block of at least one position, got {num_blocks} x {block_size}"
            )
        layers, heads, dim, dtype, where = kv_layout(model)
        device = device or where
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (heads, num_blocks * block_size, dim)  # head-major: a row's gathered keys are contiguous per head
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.device = device
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._workspaces: dict[str, torch.Tensor] = {}

    @property
    def free(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    def grow(self, table: list[int], positions: int) -> bool:
        """Appends blocks to ``table`` until it covers ``positions``; False (``table`` unchanged) if too few are
        free."""
        need = self.blocks_for(positions) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            table.append(self._free.pop())
        return True

    def release(self, table: list[int]) -> None:
        """Returns every block of ``table`` to the pool and empties it."""
        self._free.extend(reversed(table))
        table.clear()

    def workspace(self, name: str, numel: int) -> torch.Tensor:
        """A flat scratch tensor of at least ``numel`` elements kept between calls (a model call reuses the same two
        for every layer: fresh multi-megabyte buffers every layer cost page faults that double a CPU decode step)."""
        ws = self._workspaces.get(name)
        if ws is None or ws.numel() < numel:
            ws = self._workspaces[name] = torch.empty(numel, dtype=self.k[next(iter(self.k))].dtype, device=self.device)
        return ws[:numel]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))


class PagedCall:
    """The cache a model call reads and writes, for rows with ``cached[b]`` positions in blocks ``tables[b]``
    feeding ``new[b]`` tokens (see the module's notes). Passed to the model as ``cache``, with :attr:`positions` and
    the 4-D :attr:`pad_mask` (the attention mask)."""

    def __init__(self, pool: BlockPool, tables: Sequence[Sequence[int]], cached: Sequence[int], new: Sequence[int]):
        self.pool = pool
        dev, p = pool.device, pool.block_size
        b, t = len(tables), max(new)
        blocks = max(len(tb) for tb in tables)
        s = max(c + n for c, n in zip(cached, new))
        self.width, self.slots, self.start, self.batch = t, s, 0, b
        table = torch.tensor([list(tb) + [0] * (blocks - len(tb)) for tb in tables], device=dev)  # [B, blocks]
        slot = torch.arange(s, device=dev)[None, :].expand(b, s)
        self.read = (
            table.gather(1, slot // p) * p + slot % p
        ).flatten()  # [B * S] pool slots (past a row's end: masked)
        c = torch.tensor(list(cached), device=dev)[:, None]
        q = torch.arange(t, device=dev)[None, :]
        qpos = c + q - (t - torch.tensor(list(new), device=dev)[:, None])  # positions of the fed tokens
        real = qpos >= c
        self.positions = qpos.clamp(min=0)
        self.pad_mask = (torch.arange(s, device=dev)[None, None, :] <= self.positions[:, :, None])[:, None]
        rows = torch.arange(b, device=dev)[:, None].expand(b, t)
        self.src = (rows * t + q)[real]  # [N] flat (row, query) of the real new tokens
        wpos = qpos[real]
        self.write = table[rows[real], wpos // p] * p + wpos % p

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the real new ``k, v [B, H_kv, T, D]`` into the pool; every row's keys and values ``[B, H_kv, S, D]``,
        stored head-major (a view of one ``[H_kv, B, S, D]`` buffer, which the model's attention uses as it is)."""
        out = []
        for name, new, pool in (("k", k, self.pool.k[layer]), ("v", v, self.pool.v[layer])):
            heads, dim = new.shape[1], new.shape[3]
            flat = new.transpose(0, 1).reshape(heads, self.batch * self.width, dim)
            pool.index_copy_(1, self.write, flat.index_select(1, self.src).to(pool.dtype))
            # one buffer per name serves every layer, which is done with its keys before the next layer asks
            gathered = self.pool.workspace(name, heads * self.batch * self.slots * dim).view(heads, -1, dim)
            torch.index_select(pool, 1, self.read, out=gathered)
            out.append(gathered.view(heads, self.batch, self.slots, dim).transpose(0, 1))
        return out[0], out[1]
