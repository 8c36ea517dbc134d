"""A paged key/value cache: fixed-size blocks from one preallocated pool, a block table per sequence.

**The pool.** Per layer, keys and values are one tensor each, ``[H_kv, N * P, D]`` (head-major): ``N`` blocks of
``P`` positions (``block_size``). Position ``p`` of a sequence whose block table is ``[b_0, b_1, ...]`` lives in pool
slot ``b_{p // P} * P + p % P``. A sequence holds ``ceil(L / P)`` blocks for its ``L`` cached positions, so memory
follows the tokens actually held (at most ``P - 1`` positions wasted per sequence), and a finished sequence's
blocks go straight back to the pool (its full blocks stay cached there, for sequences that share their prefix,
until the pool hands them out again: :mod:`.prefix`). Bytes: ``2 * n_layers * N * P * H_kv * D * element_size``
(:func:`block_bytes` is one block of every layer). Multi-head latent attention keeps one row of ``L + r``
(``kv_lora_rank + qk_rope_head_dim``) values per position and layer instead, ``n_layers * N * P * (L + r) *
element_size`` (:meth:`PagedCall.update_latent`; the absorbed decode attends to those rows). The pool starts
zeroed, so a slot read but masked out never holds NaN (a masked score times a NaN value would still be NaN).

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

**Sliding windows** (``Attention.window``: the query at ``q`` sees keys ``q - w < k <= q``). A windowed layer
gathers only each row's last ``S_w = min(S, T + w - 1)`` positions, ``L_b - S_w ..`` (every key its real queries
see), into a ``[H_kv, B, S_w, D]`` buffer, and its mask is the band (:meth:`PagedCall.mask`: the attention asks the
call for its layer's mask; a padding query takes its row's first real query's band, so no row is empty). When every
layer is windowed, a block all of whose positions lie below ``c - w + 1`` (the first key a query at ``c``, the next
one fed, can see) is freed back to the pool as the sequence runs (:meth:`BlockPool.slide`); its table entry becomes
:data:`FREED` (read as block 0 where a row's span still covers it, and masked). A decoding sequence then holds at
most ``ceil(w / P) + 1`` blocks, a prefill chunk of ``n`` tokens ``ceil((w + n - 1) / P) + 1``. With one
full-attention layer every position stays visible to it, so nothing is freed: a mixed pattern (Qwen2's, Gemma's)
holds ``ceil(L / P)`` blocks as full attention does, and only its windowed layers read less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .prefix import Blocks
from .requests import PoolTooSmall

__all__ = ["FREED", "BlockPool", "PagedCall", "block_bytes", "kv_layout", "layer_windows", "pool_blocks"]

FREED = -1  #: a block table entry whose block slid out of every layer's window and went back to the pool


def kv_layout(model) -> tuple[list[int], int, int, torch.dtype, torch.device]:
    """``(layer ids, key/value heads held, head dim, dtype, device)`` of ``model``'s cache (a tensor-parallel
    plan may hold a slice of the heads). Latent attention caches one row of ``kv_lora_rank + qk_rope_head_dim``
    values a token (reported as one head of that size; no values: :func:`latent`)."""
    attn = next(iter(model.layers.values())).attn
    head_dim = model.cfg.head_dim
    if latent(model):
        kv_heads, head_dim = 1, model.cfg.kv_lora_rank + model.cfg.qk_rope_head_dim
    elif attn.fused:
        kv_heads = attn.qkv_proj.out_features // ((attn.rep + 2) * head_dim)
    else:
        kv_heads = attn.k_proj.out_features // head_dim
    p = next(model.parameters())
    dtype = p.dtype if p.dtype.is_floating_point else torch.float32
    return [blk.attn.layer_id for blk in model.layers.values()], kv_heads, head_dim, dtype, p.device


def latent(model) -> bool:
    """Whether ``model``'s layers cache a compressed latent (multi-head latent attention): the pool then keeps one
    row per position and layer, no separate keys and values (:meth:`PagedCall.update_latent`)."""
    return model.cfg.attention == "mla"


def layer_windows(model) -> dict[int, int | None]:
    """Each layer's sliding window by layer id (None: full causal attention, or a window no shorter than the
    context, which never cuts)."""
    context = model.cfg.max_seq_len
    windows = {blk.attn.layer_id: blk.attn.window for blk in model.layers.values()}
    return {i: None if w is not None and context is not None and w >= context else w for i, w in windows.items()}


def block_bytes(model, block_size: int) -> int:
    """Bytes of one block of every layer's keys and values."""
    layers, heads, dim, dtype, _ = kv_layout(model)
    parts = 1 if latent(model) else 2  # keys and values, or the latent rows alone
    return parts * len(layers) * block_size * heads * dim * torch.empty((), dtype=dtype).element_size()


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
    """``num_blocks`` blocks of ``block_size`` positions for every layer of ``model``, allocated once.

    ``windows``: each layer's sliding window; ``slide_window``: the longest of them when every layer has one (blocks
    slide out of it and are freed), None when some layer attends to every position (nothing is ever freed).
    ``blocks``: who holds which block, and the prefix cache when ``prefix_caching`` (:mod:`.prefix`)."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, device=None, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a KV pool needs at least one block of at least one position, got {num_blocks} x {block_size}"
            )
        layers, heads, dim, dtype, where = kv_layout(model)
        device = device or where
        self.num_blocks, self.block_size = num_blocks, block_size
        self.windows = layer_windows(model)
        spans = set(self.windows.values())
        self.slide_window: int | None = None if None in spans else max(spans)
        shape = (heads, num_blocks * block_size, dim)  # head-major: a row's gathered keys are contiguous per head
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {} if latent(model) else {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.device = device
        self.blocks = Blocks(num_blocks, block_size, prefix_caching)
        self._workspaces: dict[str, torch.Tensor] = {}

    @property
    def free(self) -> int:
        """Blocks not held by any sequence (cached prefix blocks among them: handed out when needed)."""
        return self.blocks.free

    @property
    def used(self) -> int:
        return self.num_blocks - self.blocks.free

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    @property
    def chunk_cap(self) -> int:
        """Every layer windowed: the most tokens one call may feed a sequence so that its blocks,
        ``ceil((w + n - 1) / P) + 1``, fit in the pool (below 1: not even a decode step does)."""
        return (self.num_blocks - 1) * self.block_size - self.slide_window + 1

    def room(self, prompt: int, context: int) -> int:
        """The positions a sequence with a ``prompt``-token prompt may reach: ``context`` when every layer is
        windowed (it holds its window, not its length), else the whole pool's. :class:`PoolTooSmall` (one line) for
        a prompt, or a window and a block, that the pool can never hold."""
        capacity = self.num_blocks * self.block_size
        if self.slide_window is None and prompt + 1 > capacity:
            raise PoolTooSmall(
                f"the prompt is {prompt} tokens; the KV pool holds {capacity} positions ({self.num_blocks} blocks of "
                f"{self.block_size}): give the server more KV cache memory"
            )
        if self.slide_window is not None and self.chunk_cap < 1:
            raise PoolTooSmall(
                f"the KV pool holds {capacity} positions ({self.num_blocks} blocks of {self.block_size}), too few for "
                f"the sliding window of {self.slide_window} and a block: give the server more KV cache memory"
            )
        return capacity if self.slide_window is None else context

    @staticmethod
    def held(table: Sequence[int]) -> int:
        """Blocks of ``table`` still held (not :data:`FREED`)."""
        return sum(b != FREED for b in table)

    def grow(self, table: list[int], positions: int) -> bool:
        """Appends blocks to ``table`` until it covers ``positions``; False (``table`` unchanged) if too few are
        free."""
        need = self.blocks_for(positions) - len(table)
        if need > self.blocks.free:
            return False
        for _ in range(max(0, need)):
            table.append(self.blocks.take())
        return True

    def release(self, table: list[int]) -> None:
        """Returns every block of ``table`` to the pool (the last first: cached, it is evicted first) and empties it."""
        for b in reversed(table):
            if b != FREED:
                self.blocks.drop(b)
        table.clear()

    def slide(self, table: list[int], cached: int) -> int:
        """Frees the blocks of ``table`` (a sequence with ``cached`` positions, its next query at ``cached`` or
        later) whose positions all lie before every window of it, ``< cached - slide_window + 1``, marking them
        :data:`FREED`; how many were freed (none when some layer has no window)."""
        if self.slide_window is None:
            return 0
        freed = 0
        # freed entries are a prefix of the table: walk back from the last block to free, to the first freed one
        for j in range(min(len(table), (cached - self.slide_window + 1) // self.block_size) - 1, -1, -1):
            if table[j] == FREED:
                break
            self.blocks.drop(table[j])
            table[j] = FREED
            freed += 1
        return freed

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
    the 4-D :attr:`pad_mask` (a full-attention layer's mask if there is one; each layer's own is :meth:`mask`)."""

    def __init__(self, pool: BlockPool, tables: Sequence[Sequence[int]], cached: Sequence[int], new: Sequence[int]):
        self.pool = pool
        self.inputs = (tables, cached, new)  # (what other ranks build the same call from: :mod:`.ranks`)
        dev, p = pool.device, pool.block_size
        b, t = len(tables), max(new)
        blocks = max(len(tb) for tb in tables)
        s = max(c + n for c, n in zip(cached, new))
        self.width, self.slots, self.start, self.batch = t, s, 0, b
        # [B, blocks]; a freed block is read as block 0 (only where every query of the row masks it out)
        table = torch.tensor([[max(x, 0) for x in tb] + [0] * (blocks - len(tb)) for tb in tables], device=dev)
        c = torch.tensor(list(cached), device=dev)[:, None]
        n = torch.tensor(list(new), device=dev)[:, None]
        q = torch.arange(t, device=dev)[None, :]
        qpos = c + q - (t - n)  # positions of the fed tokens
        real = qpos >= c
        self.positions = qpos.clamp(min=0)
        band = torch.maximum(qpos, c)[:, :, None]  # a padding query takes its row's first real query's window
        # per window (None: full attention): pool slots read [B * S_w] and mask [B, 1, T, S_w]; slot j of row b
        # holds position first_b + j, first_b = max(0, L_b - S_w)
        self._read: dict[int | None, tuple[torch.Tensor, int]] = {}
        self._mask: dict[int | None, torch.Tensor] = {}
        for w in set(pool.windows.values()):
            span = s if w is None else min(s, t + w - 1)
            kpos = (c + n - span).clamp(min=0) + torch.arange(span, device=dev)[None, :]  # [B, S_w]
            self._read[w] = ((table.gather(1, kpos // p) * p + kpos % p).flatten(), span)
            keys = kpos[:, None, :]
            mask = keys <= self.positions[:, :, None] if w is None else (keys <= band) & (keys > band - w)
            self._mask[w] = mask[:, None]
        self.pad_mask = self._mask[None if None in self._mask else pool.slide_window]
        rows = torch.arange(b, device=dev)[:, None].expand(b, t)
        self.src = (rows * t + q)[real]  # [N] flat (row, query) of the real new tokens
        wpos = qpos[real]
        self.write = table[rows[real], wpos // p] * p + wpos % p

    def mask(self, layer: int) -> torch.Tensor:
        """The attention mask ``[B, 1, T, S_w]`` of layer ``layer`` (True: may attend) over the keys :meth:`update`
        returns for it: causal up to each row's end, and within the layer's window if it has one."""
        return self._mask[self.pool.windows[layer]]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the real new ``k, v [B, H_kv, T, D]`` into the pool; every row's keys and values ``[B, H_kv, S_w, D]``
        (``S_w = S`` for a full-attention layer), stored head-major (a view of one ``[H_kv, B, S_w, D]`` buffer, which
        the model's attention uses as it is)."""
        return tuple(self._write_read(layer, (("k", k, self.pool.k[layer]), ("v", v, self.pool.v[layer]))))

    def update_latent(self, layer: int, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Latent attention's :meth:`update`: writes the real new ``rows [B, T, L + r]`` (latent and rotated key) into
        the pool; every row's cached rows ``[B, S, L + r]``."""
        (got,) = self._write_read(layer, (("k", rows[:, None], self.pool.k[layer]),))
        return got[:, 0]

    def _write_read(self, layer: int, parts) -> list[torch.Tensor]:
        read, span = self._read[self.pool.windows[layer]]
        out = []
        for name, new, pool in parts:
            heads, dim = new.shape[1], new.shape[3]
            flat = new.transpose(0, 1).reshape(heads, self.batch * self.width, dim)
            pool.index_copy_(1, self.write, flat.index_select(1, self.src).to(pool.dtype))
            # one buffer per name serves every layer, which is done with its keys before the next layer asks
            gathered = self.pool.workspace(name, heads * self.batch * span * dim).view(heads, -1, dim)
            torch.index_select(pool, 1, read, out=gathered)
            out.append(gathered.view(heads, self.batch, span, dim).transpose(0, 1))
        return out
