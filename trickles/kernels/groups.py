"""The communicators the loss operators reach by name.

A custom operator's arguments are tensors and plain values, so an operator that runs collectives takes its group by
name, as torch's functional collectives do (``ProcessGroup.group_name``, which
``torch.distributed.distributed_c10d._resolve_process_group`` turns back into the group). trickles' collectives are
counted (the byte ledger of :class:`~trickles.comm.GroupComm`), so the loss operators resolve the name to the
communicator that counts them rather than to the bare group: :func:`comm_name` registers a communicator under its
group's name just before the operator is called, and :func:`named_comm` finds it inside. Nothing here chooses a group:
every caller names the one it was handed (two communicators over one process group, such as ``tp`` and ``world`` on
a 1-D mesh: the one named last, which eagerly is always the caller's).
"""

from __future__ import annotations

import weakref

import torch

#: group name -> the communicator (anything with ``all_reduce(tensor, op=...)``) registered under it, held weakly
_COMMS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def comm_name(comm) -> str:
    """The name an operator takes for ``comm``: its process group's ``group_name`` (a communicator without a group, such
    as a 1-rank :class:`~trickles.comm.GroupComm`: one made from its own name and identity), registering ``comm``
    under it. While ``torch.compile`` traces, nothing is registered (a compiled graph would run its operators before
    any side effect of its Python code): the communicator must have been named once outside, as the loss heads do when
    they are built."""
    group = getattr(comm, "group", None)
    name = group.group_name if group is not None else f"trickles:{getattr(comm, 'name', 'comm')}:{id(comm)}"
    if not torch.compiler.is_compiling():
        _COMMS[name] = comm
    return name


def named_comm(name: str):
    """The communicator registered under ``name`` by :func:`comm_name`."""
    comm = _COMMS.get(name)
    if comm is None:
        raise RuntimeError(
            f"no communicator is registered for process group {name!r}: pass the name comm_name(comm) returns "
            f"(trickles.kernels.groups), which registers it"
        )
    return comm
