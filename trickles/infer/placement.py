"""Which transformer blocks stay resident on the device and which stream, given a memory budget.

A streamed block lives in host memory (pinned, on CUDA) or in the checkpoint's memory-mapped
files (CPU) and is copied into one of two reusable device buffers just before it runs, while the
block before it computes. With per-block bytes ``b_0..b_{n-1}``, fixed bytes ``F`` (embeddings,
final norm, output projection, KV cache) and budget ``M``, streaming a set ``S`` of ``s`` blocks
costs on the device

    F + sum(b_i for i not in S) + min(2, s) * max(b_i for i in S)

(two buffers, each as large as the largest streamed block; one when only one block streams).
The plan streams the fewest blocks that make this fit (``s = 0`` when the whole model fits).
With equal blocks of ``b`` bytes that is ``s = n - floor((M - F - 2b) / b)``, and streaming one
or two blocks saves nothing over keeping them (their buffers cost what they do), so a plan that
streams at all streams at least three.

The streamed blocks are spaced as far apart as possible: one block's copy takes longer than its
compute (BMInf), so every streamed block should be preceded by as many resident blocks as
possible, whose compute hides its copy. Decoding runs the blocks cyclically (block ``n-1`` of one
token is followed by block 0 of the next), so the ``s`` streamed blocks are placed evenly on that
cycle, ``i_j = floor((j + 1/2) n / s)`` for ``j = 0..s-1``: consecutive streamed blocks are
``floor(n/s)`` or ``ceil(n/s)`` apart, which maximizes the smallest gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

__all__ = ["Placement", "plan_placement", "spaced"]


@dataclass(frozen=True)
class Placement:
    """The outcome of :func:`plan_placement` (all sizes in bytes)."""

    resident: tuple[int, ...]  #: indices of the blocks kept on the device
    streamed: tuple[int, ...]  #: indices of the blocks copied in before each use, ascending
    buffer_bytes: int  #: size of each of the reusable device buffers (0 when nothing streams)
    n_buffers: int  #: how many buffers: min(2, number streamed)
    device_bytes: int  #: what the plan keeps on the device: fixed + resident blocks + buffers
    budget_bytes: int  #: the budget it was made for

    @property
    def streams(self) -> bool:
        return bool(self.streamed)

    def summary(self) -> str:
        """One line: how many blocks stream, which, and the bytes against the budget."""
        n = len(self.resident) + len(self.streamed)
        which = f" (blocks {', '.join(map(str, self.streamed))})" if self.streamed else ""
        return (
            f"device budget {self.budget_bytes / 1e9:.3g} GB: {len(self.streamed)} of {n} blocks stream{which}, "
            f"{self.device_bytes / 1e9:.3g} GB on the device with {self.n_buffers} buffer(s) of "
            f"{self.buffer_bytes / 1e6:.3g} MB"
        )


def spaced(n: int, s: int) -> tuple[int, ...]:
    """``s`` of the indices ``0..n-1`` spread evenly around the cycle: ``floor((j + 1/2) n / s)``."""
    if not 0 <= s <= n:
        raise ValueError(f"cannot choose {s} of {n} blocks")
    return tuple(((2 * j + 1) * n) // (2 * s) for j in range(s))


def _cost(block_bytes: list[int], fixed: int, streamed: tuple[int, ...]) -> tuple[int, int, int]:
    """``(device bytes, buffer bytes, buffers)`` of streaming ``streamed``."""
    chosen = set(streamed)
    resident = sum(b for i, b in enumerate(block_bytes) if i not in chosen)
    buf = max((block_bytes[i] for i in streamed), default=0)
    k = min(2, len(streamed))
    return fixed + resident + k * buf, buf, k


def plan_placement(block_bytes: list[int], fixed_bytes: int, budget_bytes: int) -> Placement:
    """The fewest streamed blocks, spaced evenly, that keep the device within ``budget_bytes``.

    Raises :class:`~trickles.errors.UserError` (saying the least budget that works) when even
    streaming every block does not fit: the fixed bytes plus two buffers of the largest block.
    """
    n = len(block_bytes)
    if budget_bytes <= 0:
        raise UserError(f"the device budget must be positive, got {budget_bytes} bytes")
    for s in range(n + 1):
        streamed = spaced(n, s)
        used, buf, k = _cost(block_bytes, fixed_bytes, streamed)
        if used <= budget_bytes:
            resident = tuple(i for i in range(n) if i not in set(streamed))
            return Placement(resident, streamed, buf, k, used, budget_bytes)
    least, _, _ = _cost(block_bytes, fixed_bytes, spaced(n, n))
    raise UserError(
        f"a device budget of {budget_bytes / 1e9:.3g} GB is too small for this model: streaming every block "
        f"still needs {least / 1e9:.3g} GB (embeddings, output projection and KV cache {fixed_bytes / 1e9:.3g} GB "
        f"+ two buffers of the largest block, {max(block_bytes, default=0) / 1e9:.3g} GB each); give at least that, "
        "or fewer samples or positions (a smaller KV cache)"
    )
