"""The collectives of one process group, counted: :class:`GroupComm`, and :class:`Handle` for the asynchronous ones.

Every call goes through a :class:`GroupComm` (one per parallel dimension, handed out by the
:class:`~trickles.topology.Topology`), which records its bytes into a :class:`~trickles.comm.ledger.CommLedger`
(the formulas: :mod:`trickles.comm.ledger`) and runs between ``flight.begin`` and ``flight.end``
(:mod:`trickles.comm.recorder`) while it blocks.

A group of size 1 (or ``group=None``) makes every call a no-op that records nothing, so
single-device code pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .ledger import CommLedger, wire_bytes
from .recorder import flight

# torch >= 2.12 renames the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}


class Handle:
    """An asynchronous collective in flight; ``wait()`` blocks until it is done."""

    def __init__(self, work, what: str, result=None, after: Callable[[], None] | None = None):
        self._work, self._what, self.result, self._after = work, what, result, after

    def done(self) -> bool:
        """True once the collective has completed (``wait`` then returns at once)."""
        return self._work is None or self._work.is_completed()

    def wait(self):
        if self._work is not None:
            flight.begin(self._what)
            try:
                self._work.wait()
            finally:
                flight.end()
            self._work = None
            if self._after is not None:
                self._after()
        return self.result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GroupComm:
    """The collectives of one process group, recorded under the group's name."""

    def __init__(self, name: str, group, ledger: CommLedger):
        self.name = name
        self.group = group
        self.ledger = ledger
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.backend = dist.get_backend(group) if group is not None else None
        # NCCL averages natively; gloo has no AVG, so "mean" there is a sum divided afterwards
        self._native_avg = self.backend == "nccl"

    def _op(self, op: str, n_div_target: torch.Tensor):
        """The reduce op to issue and what to run after completion for ``op``."""
        if op == "mean" and self._native_avg:
            return dist.ReduceOp.AVG, None
        return _REDUCE_OPS[op], ((lambda: n_div_target.div_(self.size)) if op == "mean" else None)

    def __repr__(self) -> str:
        return f"GroupComm({self.name}, rank {self.rank} of {self.size})"

    def global_rank(self, group_rank: int) -> int:
        """Global rank of member ``group_rank`` of this group."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _run(self, op: str, t: torch.Tensor, wire: float, fn: Callable, async_op: bool, result=None, after=None):
        self.ledger.record(op, self.name, _nbytes(t), wire)
        what = f"{op} on group '{self.name}' ({self.size} ranks, {tuple(t.shape)} {str(t.dtype).replace('torch.', '')})"
        if async_op:
            return Handle(fn(True), what, result, after)
        flight.begin(what)
        try:
            fn(False)
        finally:
            flight.end()
        if after is not None:
            after()
        return result

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        """In-place reduction over the group (``op``: sum, mean, max, min); returns ``t`` (or a Handle)."""
        if self.size == 1:
            return Handle(None, "", t) if async_op else t
        n = self.size
        red, after = self._op(op, t)
        return self._run(
            "all_reduce",
            t,
            wire_bytes("all_reduce", _nbytes(t), n),
            lambda a: dist.all_reduce(t, red, group=self.group, async_op=a),
            async_op,
            t,
            after,
        )

    def all_gather(self, t: torch.Tensor, dim: int = 0, async_op: bool = False, out: torch.Tensor | None = None):
        """Concatenation of every rank's ``t`` along ``dim`` in rank order.

        ``out`` (dim 0 only) receives the result in place; it may hold ``t`` as this rank's
        chunk. Asynchronous calls gather along dim 0.
        """
        if self.size == 1:
            if out is not None and out.data_ptr() != t.data_ptr():
                out.copy_(t)
            t = out if out is not None else t
            return Handle(None, "", t) if async_op else t
        if (async_op or out is not None) and dim != 0:
            raise ValueError("an asynchronous or in-place all_gather gathers along dim 0")
        n, t = self.size, t.contiguous()
        if out is None:
            out = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        res = self._run(
            "all_gather",
            t,
            wire_bytes("all_gather", _nbytes(t), n),
            lambda a: _all_gather_single(out, t, group=self.group, async_op=a),
            async_op,
            out,
        )
        return res if dim == 0 else torch.cat(out.chunk(n, 0), dim=dim)

    def reduce_scatter(
        self, t: torch.Tensor, dim: int = 0, op: str = "sum", async_op: bool = False, out: torch.Tensor | None = None
    ):
        """Reduces ``t`` over the group and returns this rank's chunk along ``dim``.

        ``out`` (dim 0 only) receives the chunk in place; it may be this rank's chunk of ``t``.
        """
        if self.size == 1:
            if out is not None and out.data_ptr() != t.data_ptr():
                out.copy_(t)
            t = out if out is not None else t
            return Handle(None, "", t) if async_op else t
        n = self.size
        if t.shape[dim] % n:
            raise ValueError(
                f"reduce_scatter on group '{self.name}': size {t.shape[dim]} of dim {dim} is not divisible by {n}"
            )
        if out is not None and dim != 0:
            raise ValueError("an in-place reduce_scatter scatters along dim 0")
        chunk_shape = list(t.shape)
        chunk_shape[dim] //= n
        if out is None:
            out = torch.empty(chunk_shape, dtype=t.dtype, device=t.device)
        if dim == 0:
            inp, out_flat = t.contiguous(), out
        else:  # lay the chunks out one after another so the collective can split dim 0
            inp, out_flat = torch.stack(t.chunk(n, dim=dim)).contiguous(), out.unsqueeze(0)
        red, after = self._op(op, out)
        return self._run(
            "reduce_scatter",
            t,
            wire_bytes("reduce_scatter", _nbytes(t), n),
            lambda a: _reduce_scatter_single(out_flat, inp, red, group=self.group, async_op=a),
            async_op,
            out,
            after,
        )

    def all_to_all(self, t: torch.Tensor, scatter_dim: int = 0, gather_dim: int = 0) -> torch.Tensor:
        """Chunk ``i`` of ``scatter_dim`` goes to rank ``i``; received chunks concatenate along ``gather_dim``."""
        if self.size == 1:
            return t
        n = self.size
        if t.shape[scatter_dim] % n:
            raise ValueError(
                f"all_to_all on group '{self.name}': size {t.shape[scatter_dim]} of dim {scatter_dim} "
                f"is not divisible by {n}"
            )
        inp = torch.stack(t.chunk(n, dim=scatter_dim)).contiguous()
        out = torch.empty_like(inp)
        self._run(
            "all_to_all",
            t,
            wire_bytes("all_to_all", _nbytes(t), n),
            lambda a: dist.all_to_all_single(out, inp, group=self.group, async_op=a),
            False,
        )
        return torch.cat(out.unbind(0), dim=gather_dim)

    def all_to_all_uneven(
        self, t: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> torch.Tensor:
        """Rows ``send_counts[i]`` of ``t`` (dim 0, in order) go to rank i; returns the received rows."""
        if self.size == 1:
            return t
        out = torch.empty((sum(recv_counts), *t.shape[1:]), dtype=t.dtype, device=t.device)
        own = send_counts[self.rank] * t[0].numel() * t.element_size() if t.shape[0] else 0
        self._run(
            "all_to_all",
            t,
            _nbytes(t) - own,
            lambda a: dist.all_to_all_single(
                out, t.contiguous(), list(recv_counts), list(send_counts), group=self.group, async_op=a
            ),
            False,
        )
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copies group rank ``src``'s ``t`` into every rank's ``t``."""
        if self.size == 1:
            return t
        self._run(
            "broadcast",
            t,
            _nbytes(t) if self.rank == src else 0,
            lambda a: dist.broadcast(t, self.global_rank(src), group=self.group, async_op=a),
            False,
        )
        return t

    def barrier(self, limit_s: float | None = None) -> None:
        """Waits for every rank of the group; ``limit_s``: how long the hang watchdog lets it take."""
        if self.size > 1:
            flight.begin(f"barrier on group '{self.name}'", limit_s)
            try:
                dist.barrier(group=self.group)
            finally:
                flight.end()

    # ---- point to point ------------------------------------------------------------------
    def send(self, t: torch.Tensor, dst: int) -> None:
        """Blocking send to group rank ``dst``."""
        self._run(
            "send", t, _nbytes(t), lambda a: dist.send(t.contiguous(), self.global_rank(dst), group=self.group), False
        )

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Blocking receive from group rank ``src`` into ``t``."""
        self.ledger.record("recv", self.name, _nbytes(t), 0)
        flight.begin(f"recv on group '{self.name}' from rank {src} ({tuple(t.shape)})")
        try:
            dist.recv(t, self.global_rank(src), group=self.group)
        finally:
            flight.end()
        return t

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[Handle]:
        """Starts ``[("send" | "recv", tensor, group peer), ...]`` together; returns a Handle per op.

        Batching the sends and receives of a step lets neighbouring ranks exchange in both
        directions without ordering deadlocks. Where the backend runs each op on its own (gloo),
        each Handle waits for its op alone, so a receive can be waited for while the sends posted
        with it are still in flight; where it coalesces the batch (NCCL), every Handle waits for
        the whole batch.
        """
        p2p = []
        for kind, t, peer in ops:
            if kind not in ("send", "recv"):
                raise ValueError(f"batch_p2p: unknown operation {kind!r} (send or recv)")
            self.ledger.record(kind, self.name, _nbytes(t), _nbytes(t) if kind == "send" else 0)
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, t, self.global_rank(peer), group=self.group))
        if not p2p:
            return []
        works = dist.batch_isend_irecv(p2p)
        what = [f"{kind} on group '{self.name}' with rank {peer} ({tuple(t.shape)})" for kind, t, peer in ops]
        if len(works) == len(p2p):
            return [Handle(w, w_what) for w, w_what in zip(works, what)]

        class _Whole:  # one work for the coalesced batch
            def wait(self_inner):
                for w in works:
                    w.wait()

            def is_completed(self_inner):
                return all(w.is_completed() for w in works)

        whole = _Whole()
        return [Handle(whole, f"batch_p2p on group '{self.name}' ({len(p2p)} ops)") for _ in p2p]
