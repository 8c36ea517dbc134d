"""The block pool's allocator, with automatic prefix caching (vLLM's, on by default there since its V1 engine).

**Blocks and references.** A block is free (on the free list), held (by one or more sequences: its reference count),
or cached and free: its keys and values are those of a known prefix and it waits, unreferenced, on a least-recently
used list. :attr:`Blocks.free` counts the free and the cached-free blocks: both can be handed out, the free list
first, then the cached block least recently released, whose cache entry is then dropped (eviction). So caching never
costs a sequence a block, and a pool too small to keep everything evicts as it goes.

**Keys.** Block ``j`` of a sequence, once full (its ``P`` positions in the pool), is identified by the hash of its
tokens and of the key of block ``j - 1`` (so, by the whole prefix ``0 .. (j + 1) P - 1``): ``blake2b`` of the parent's
16-byte key and the token ids. Block 0's parent is the sequence's ``salt``: its LoRA adapter's name (empty for the base
model), since an adapter's keys and values differ from the base's for the same tokens. :meth:`Blocks.register` enters
a sequence's newly full blocks into the cache (a key already cached keeps its first block; the copy stays uncached
and returns to the free list when released).

**Reuse.** :meth:`Blocks.share` looks up a new sequence's full blocks in order and hands it the cached ones, up to the
first miss and leaving at least its last token to be fed (a call must produce its next-token logits): the sequence
starts with those positions cached and prefills only the rest. Shared blocks are full, and a sequence writes only at
its positions past what it holds, so no block is written by two sequences. A block's keys and values depend only on
its prefix, so a block freed early (slid out of every sliding window, :meth:`trickles.infer.paged.BlockPool.slide`)
stays a correct cache entry for its key, and a sequence that reuses it frees again at once what its own window does
not reach. A request that needs logits at every prompt position (prompt log-probabilities) takes no cached block.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

__all__ = ["Blocks", "block_keys"]


def block_keys(tokens: Sequence[int], block_size: int, keys: list[bytes], upto: int, salt: bytes = b"") -> list[bytes]:
    """``keys`` (a sequence's keys so far, extended in place) covering its first ``upto`` full blocks; ``salt``: the
    parent of block 0."""
    while len(keys) < upto:
        j = len(keys)
        h = hashlib.blake2b(keys[-1] if keys else salt, digest_size=16)
        h.update(b",".join(str(t).encode() for t in tokens[j * block_size : (j + 1) * block_size]))
        keys.append(h.digest())
    return keys


class Blocks:
    """Allocation of ``num_blocks`` blocks of ``block_size`` positions, with reference counts and, when ``caching``,
    the prefix cache (see the module's notes). ``queries`` and ``hits``: tokens looked up and found by :meth:`share`;
    ``evicted``: cache entries dropped to hand their blocks out."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; oldest first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.queries = self.hits = self.evicted = 0

    @property
    def free(self) -> int:
        """Blocks that can be handed out: free, or cached and unreferenced."""
        return len(self._free) + len(self._lru)

    @property
    def cached(self) -> int:
        """Blocks holding a cache entry (referenced or not)."""
        return len(self._key_of)

    def take(self) -> int:
        """A block for one sequence: a free one, else the least recently released cached one (evicted)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._lru.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
            self.evicted += 1
        self._refs[b] = 1
        return b

    def drop(self, block: int) -> None:
        """One reference fewer to ``block``; unreferenced, it is free, or cached-free when it holds a cache entry."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    def share(self, tokens: Sequence[int], keys: list[bytes], salt: bytes = b"") -> list[int]:
        """The cached blocks of the longest cached prefix of ``tokens`` (whole blocks, its last token left out), each
        with one more reference; ``keys``: the sequence's block keys (extended), ``salt``: block 0's parent."""
        usable = (len(tokens) - 1) // self.block_size if self.caching else 0
        out = []
        for key in block_keys(tokens, self.block_size, keys, usable, salt):
            b = self._block_of.get(key)
            if b is None:
                break
            self._lru.pop(b, None)
            self._refs[b] += 1
            out.append(b)
        self.queries += len(tokens)
        self.hits += len(out) * self.block_size
        return out

    def register(
        self, table: Sequence[int], tokens: Sequence[int], cached: int, keys: list[bytes], start: int, salt: bytes = b""
    ) -> int:
        """Enters the full blocks from ``start`` on of a sequence (``table``, ``tokens``, ``cached`` positions in the
        pool) into the cache, skipping entries below zero (blocks already freed); the blocks now entered or passed
        over, the next call's ``start``."""
        full = min(cached // self.block_size, len(table))
        if not self.caching or full <= start:
            return start
        for j in range(start, full):
            b, key = table[j], block_keys(tokens, self.block_size, keys, j + 1, salt)[j]
            if b >= 0 and b not in self._key_of and key not in self._block_of:
                self._key_of[b], self._block_of[key] = key, b
        return full
