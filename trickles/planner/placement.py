"""Which ranks form each group, and whether a group spans nodes -- from the degrees alone, no process group.

Ranks are laid out ``(pp, dp, cp, tp)``, outermost first (:mod:`trickles.topology`):
``rank = ((pp_i dp + dp_i) cp + cp_i) tp + tp_i``, so a dimension's ranks are ``stride`` apart -- ``tp``: 1,
``cp``: ``tp``, ``dp``: ``cp tp``, ``pp``: ``dp cp tp`` -- and consecutive ranks fill a node first. A group of
``n`` ranks ``stride`` apart lies inside one node exactly when all its members fall in the same block of
``ranks_per_node`` consecutive ranks. The other groups are built as :class:`~trickles.topology.ParallelDims`
builds them: ``dp_cp`` (the replicas, with context parallelism), ``ep`` (blocks of ``ep`` consecutive replicas),
``edp`` (every ``ep``-th replica), ``pp_ends`` (first and last stage), and a grid's ``tp_row``, ``tp_col``,
``tp_dep`` lines (:class:`~trickles.topology.TPGrid`).

The time model takes the worst group of a kind: if any ``tp`` group crosses a node boundary, every ``tp``
collective is timed on the inter-node link (all groups of a kind run the same collectives at once, so the step
waits for the slowest).
"""

from __future__ import annotations

from functools import lru_cache

from ..topology import MESH_DIMS, ParallelDims

GROUPS = (*MESH_DIMS, "dp_cp", "ep", "edp", "pp_ends", "tp_row", "tp_col", "tp_dep", "world")


def stride(dims: ParallelDims, name: str) -> int:
    """Distance between consecutive ranks of mesh dimension ``name`` (``pp``, ``dp``, ``cp``, ``tp``)."""
    out = 1
    for inner in reversed(MESH_DIMS):
        if inner == name:
            return out
        out *= getattr(dims, inner)
    raise ValueError(f"{name!r} is not a mesh dimension ({', '.join(MESH_DIMS)})")


def group_members(dims: ParallelDims, name: str) -> list[list[int]]:
    """Every group of kind ``name`` (:data:`GROUPS`) as lists of global ranks; ``[]`` when the layout has none."""
    world = dims.world_size
    if name in MESH_DIMS:
        s, n = stride(dims, name), getattr(dims, name)
        return [[r + k * s for k in range(n)] for r in range(world) if (r // s) % n == 0]
    if name == "world":
        return [list(range(world))]
    replicas = list(dims._replica_members())
    if name == "dp_cp":
        return replicas
    if name == "ep":
        return [m[i : i + dims.ep] for m in replicas for i in range(0, len(m), dims.ep)]
    if name == "edp":
        return [m[j :: dims.ep] for m in replicas for j in range(dims.ep)]
    if name == "pp_ends":
        pp = group_members(dims, "pp")
        return [[m[0], m[-1]] for m in pp] if dims.pp > 1 else []
    if name in ("tp_row", "tp_col", "tp_dep"):
        grid = dims.grid
        if grid.mode == "1d" or (name == "tp_dep" and grid.depth == 1):
            return []
        return [[base + t for t in line] for base in range(0, world, dims.tp) for line in grid.lines(name)]
    raise ValueError(f"unknown group {name!r}; one of {', '.join(GROUPS)}")


@lru_cache(maxsize=4096)
def spans_nodes(dims: ParallelDims, name: str, ranks_per_node: int) -> bool:
    """Whether any group of kind ``name`` has ranks on two nodes of ``ranks_per_node`` consecutive ranks each."""
    return any(len({r // ranks_per_node for r in members}) > 1 for members in group_members(dims, name))


def pipeline_hop_spans_nodes(dims: ParallelDims, ranks_per_node: int) -> bool:
    """Whether any message between neighbouring pipeline stages (the last wrapping to the first, as interleaving
    sends) crosses nodes."""
    for members in group_members(dims, "pp"):
        nodes = [r // ranks_per_node for r in members]
        if any(a != b for a, b in zip(nodes, nodes[1:] + nodes[:1])):
            return True
    return False


def group_size(dims: ParallelDims, name: str) -> int:
    """Ranks in each group of kind ``name``."""
    grid = dims.grid
    sizes = {
        "pp": dims.pp,
        "dp": dims.dp,
        "cp": dims.cp,
        "tp": dims.tp,
        "dp_cp": dims.dp * dims.cp,
        "ep": dims.ep,
        "edp": dims.dp * dims.cp // dims.ep,
        "pp_ends": 2 if dims.pp > 1 else 1,
        "tp_row": grid.q,
        "tp_col": grid.q,
        "tp_dep": grid.depth,
        "world": dims.world_size,
    }
    if name not in sizes:
        raise ValueError(f"unknown group {name!r}; one of {', '.join(GROUPS)}")
    return sizes[name]
