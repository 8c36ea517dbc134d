"""Autograd-aware collectives (Megatron's conjugate pairs), the collectives parallel layers call.

``x`` being the local tensor:

  ===========================  ===========================  ============================
  function                     forward                      backward
  ===========================  ===========================  ============================
  ``copy_to_region``           identity                     all-reduce
  ``reduce_from_region``       all-reduce                   identity
  ``scatter_to_region``        keep own chunk of ``dim``    all-gather along ``dim``
  ``gather_from_region``       all-gather along ``dim``     keep own chunk of ``dim``
  ``gather_sequence``          all-gather along ``dim``     reduce-scatter along ``dim``
  ``reduce_scatter_sequence``  reduce-scatter along ``dim`` all-gather along ``dim``
  ``all_to_all``               all-to-all (scatter s,       all-to-all (scatter g,
                               gather g)                    gather s)
  ===========================  ===========================  ============================

Each runs its collectives through a :class:`~trickles.comm.group.GroupComm`, so they are counted like any other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .group import GroupComm


def _chunk(x: torch.Tensor, comm: GroupComm, dim: int) -> torch.Tensor:
    if x.shape[dim] % comm.size:
        raise ValueError(
            f"dim {dim} of size {x.shape[dim]} is not divisible by group '{comm.name}' of {comm.size} ranks"
        )
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


class _Conjugate(torch.autograd.Function):
    """``y = forward(x)``; in backward ``dx = backward(dy)``: one collective each way."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward_fn = backward
        return forward(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_fn(g.contiguous()), None, None


def _all_reduced(comm: GroupComm) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: comm.all_reduce(t.clone())


def copy_to_region(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    """Identity forward, all-reduce backward (entry of a column-parallel region)."""
    return x if comm.size == 1 else _Conjugate.apply(x, lambda t: t.view_as(t), _all_reduced(comm))


def reduce_from_region(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    """All-reduce forward, identity backward (exit of a row-parallel region)."""
    return x if comm.size == 1 else _Conjugate.apply(x.contiguous(), _all_reduced(comm), lambda g: g)


def scatter_to_region(x: torch.Tensor, comm: GroupComm, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim`` forward, all-gather backward."""
    if comm.size == 1:
        return x
    dim %= x.dim()
    return _Conjugate.apply(x, lambda t: _chunk(t, comm, dim), lambda g: comm.all_gather(g, dim=dim))


def gather_from_region(x: torch.Tensor, comm: GroupComm, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` forward, keep own chunk backward."""
    if comm.size == 1:
        return x
    dim %= x.dim()
    return _Conjugate.apply(x, lambda t: comm.all_gather(t, dim=dim), lambda g: _chunk(g, comm, dim))


def gather_sequence(x: torch.Tensor, comm: GroupComm, dim: int = 1) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter backward (sequence-parallel entry)."""
    if comm.size == 1:
        return x
    dim %= x.dim()
    return _Conjugate.apply(x, lambda t: comm.all_gather(t, dim=dim), lambda g: comm.reduce_scatter(g, dim=dim))


def reduce_scatter_sequence(x: torch.Tensor, comm: GroupComm, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward (sequence-parallel exit)."""
    if comm.size == 1:
        return x
    dim %= x.dim()
    return _Conjugate.apply(x, lambda t: comm.reduce_scatter(t, dim=dim), lambda g: comm.all_gather(g, dim=dim))


def all_to_all(x: torch.Tensor, comm: GroupComm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all forward, the reverse all-to-all backward."""
    if comm.size == 1:
        return x
    s, g = scatter_dim % x.dim(), gather_dim % x.dim()
    return _Conjugate.apply(x, lambda t: comm.all_to_all(t, s, g), lambda d: comm.all_to_all(d, g, s))
