"""Who is who: parallel degrees, the device mesh, and the process group of each dimension.

Ranks are laid out on a 4-D mesh ``(pp, dp, cp, tp)``, outermost first:

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

so the ranks of one tensor-parallel group are adjacent (same node, fastest links) and pipeline
stages are furthest apart. With multi-dimensional tensor parallelism (``tp_mode`` 2d, 2.5d, 3d) the
``tp`` ranks also form a grid (:class:`TPGrid`) whose rows, columns and depth lines get groups of
their own (``tp_row``, ``tp_col``, ``tp_dep``). Expert parallelism does not add ranks: the ``ep`` groups are blocks
of ``ep`` consecutive ranks among the ``dp x cp`` ranks that share a (pp, tp) coordinate.

:class:`ParallelDims` is checked before anything starts; :meth:`ParallelDims.build` creates
the ``DeviceMesh`` and returns a :class:`Topology`, the one object every component receives to
find its groups. There is no module-level group state.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import CommLedger, GroupComm
from .errors import ConfigError
from .process import _valid_local_rank, env_world_size, init_distributed, select_device, shutdown_distributed
from .watchdog import Watchdog, backstop_timeout

MESH_DIMS = ("pp", "dp", "cp", "tp")
TP_MODES = ("1d", "2d", "2.5d", "3d")
GRID_AXES = ("tp_row", "tp_col", "tp_dep")


@dataclass(frozen=True)
class TPGrid:
    """The ``tp`` ranks of one tensor-parallel group as a grid (Colossal-AI's multi-dimensional tensor parallelism).

    ``2d``: a ``q x q`` grid (Optimus, SUMMA); ``2.5d``: ``depth`` stacked ``q x q`` grids (Tesseract); ``3d``: a
    ``q x q x q`` cube (``depth = q``); ``1d``: no grid (``q = 1``, Megatron's split). Tensor-parallel rank ``t`` sits
    at row ``i``, column ``j``, depth ``k`` with ``t = (k q + i) q + j``: a row's ranks are adjacent.
    """

    mode: str = "1d"
    q: int = 1
    depth: int = 1

    @classmethod
    def of(cls, mode: str, tp: int, depth: int = 1) -> TPGrid:
        """The grid of ``tp`` ranks in ``mode``; ConfigError naming the nearest valid ``tp`` when there is none."""
        if mode not in TP_MODES:
            raise ConfigError(f"parallel.tp_mode must be one of {', '.join(TP_MODES)}, got {mode!r}")
        if depth < 1:
            raise ConfigError(f"parallel.tp_depth must be at least 1, got {depth}")
        if mode != "2.5d" and depth != 1:
            raise ConfigError(
                f"parallel.tp_depth is the d of 2.5-D tensor parallelism; with tp_mode={mode} leave it at 1"
            )
        if mode == "1d":
            return cls()
        power, per = {"2d": (2, 1), "2.5d": (2, depth), "3d": (3, 1)}[mode]
        q = round((tp / per) ** (1 / power))
        if q < 2 or per * q**power != tp:
            valid = [per * n**power for n in range(2, 64)]
            near = sorted(valid, key=lambda v: (abs(v - tp), v))[:2]
            shape = {"2d": "q^2", "2.5d": f"q^2 x {depth} (tp_depth)", "3d": "q^3"}[mode]
            raise ConfigError(
                f"parallel.tp={tp} is not {shape} for q >= 2, as tp_mode={mode} needs; "
                f"use parallel.tp={' or '.join(map(str, sorted(near)))}"
            )
        return cls(mode, q, q if mode == "3d" else per)

    @property
    def size(self) -> int:
        return self.q * self.q * self.depth

    def coords(self, t: int) -> tuple[int, int, int]:
        """``(i, j, k)``: row, column and depth of tensor-parallel rank ``t``."""
        return (t // self.q) % self.q, t % self.q, t // (self.q * self.q)

    def rank(self, i: int, j: int, k: int) -> int:
        return (k * self.q + i) * self.q + j

    def lines(self, axis: str) -> list[list[int]]:
        """Every line of the grid along ``axis`` (``tp_row``: the ranks of one row, ``j`` varying; ``tp_col``: of one
        column, ``i`` varying; ``tp_dep``: of one ``(i, j)``, ``k`` varying), as tensor-parallel ranks."""
        q, d = self.q, self.depth
        if axis == "tp_row":
            return [[self.rank(i, j, k) for j in range(q)] for k in range(d) for i in range(q)]
        if axis == "tp_col":
            return [[self.rank(i, j, k) for i in range(q)] for k in range(d) for j in range(q)]
        return [[self.rank(i, j, k) for k in range(d)] for i in range(q) for j in range(q)]


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; ``dp * pp * cp * tp`` is the world size."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    tp_mode: str = "1d"  # how the tp ranks split each matrix (TPGrid)
    tp_depth: int = 1  # the d of 2.5-D tensor parallelism

    @classmethod
    def infer(
        cls,
        world_size: int,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        tp_mode: str = "1d",
        tp_depth: int = 1,
    ) -> ParallelDims:
        """Fills ``dp=-1`` with what the world size leaves after tp, pp and cp."""
        for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
            if v < 1:
                raise ConfigError(f"parallel.{name} must be at least 1, got {v}")
        if dp == -1:
            rest = tp * pp * cp
            if world_size % rest:
                raise ConfigError(
                    f"{world_size} processes cannot be split into parallel.tp x pp x cp = {tp} x {pp} x {cp} = {rest}; "
                    f"launch a multiple of {rest} processes, change parallel.tp/pp/cp, or set parallel.elastic=true to "
                    f"train on a layout the planner chooses for {world_size}"
                )
            dp = world_size // rest
        TPGrid.of(tp_mode, tp, tp_depth)
        return cls(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, tp_mode=tp_mode, tp_depth=tp_depth)

    @property
    def grid(self) -> TPGrid:
        return TPGrid.of(self.tp_mode, self.tp, self.tp_depth)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def validate(self, world_size: int) -> None:
        """Raises ConfigError saying which number to change."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "tp_mode":
                continue
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"parallel.{f.name} must be a positive integer, got {v!r}")
        if self.world_size != world_size:
            raise ConfigError(
                f"parallel.dp x tp x pp x cp = {self.dp} x {self.tp} x {self.pp} x {self.cp} = {self.world_size}, "
                f"but there are {world_size} processes; launch {self.world_size} processes (--nproc {self.world_size}) "
                "or change the degrees (parallel.dp=-1 fills the rest), or set parallel.elastic=true to train on a "
                f"layout the planner chooses for {world_size}"
            )
        if (self.dp * self.cp) % self.ep:
            divisors = [d for d in range(1, self.dp * self.cp + 1) if (self.dp * self.cp) % d == 0]
            raise ConfigError(
                f"parallel.ep ({self.ep}) must divide parallel.dp x parallel.cp ({self.dp * self.cp}), the ranks "
                f"experts are spread over; set parallel.ep to one of {divisors}"
            )
        self.grid  # noqa: B018  (raises for a tp the mode cannot arrange)

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank, e.g. ``{"pp": 0, "dp": 1, "cp": 0, "tp": 1, "ep": 1}``."""
        out, r = {}, rank
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            out[name] = r % size
            r //= size
        out["ep"] = (out["dp"] * self.cp + out["cp"]) % self.ep
        return {k: out[k] for k in (*MESH_DIMS, "ep")}

    def build(self, device: torch.device | None = None) -> Topology:
        """Creates the mesh and groups (the default process group must exist unless world size is 1)."""
        device = device or select_device()
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.validate(world)
        if world == 1:
            return Topology(self, None, device, {})
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(self, n) for n in MESH_DIMS)
        with _valid_local_rank(device):
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
        groups = {n: mesh.get_group(n) for n in MESH_DIMS}
        groups["ep"] = self._ep_group(dist.get_rank())
        groups["edp"] = self._expert_data_group(dist.get_rank())
        groups["dp_cp"] = self._data_group(dist.get_rank())
        groups.update(self._pipeline_groups(dist.get_rank()))
        groups.update(self._grid_groups(dist.get_rank()))
        return Topology(self, mesh, device, groups)

    def _grid_groups(self, rank: int) -> dict:
        """``tp_row``, ``tp_col`` (and ``tp_dep`` for 2.5-D and 3-D): the lines of every tensor-parallel group's grid
        (:class:`TPGrid`); every rank creates all of them."""
        grid = self.grid
        if grid.mode == "1d":
            return {}
        out = {}
        axes = GRID_AXES if grid.depth > 1 else GRID_AXES[:2]
        for base in range(0, self.world_size, self.tp):  # the first rank of each tensor-parallel group
            for axis in axes:
                for line in grid.lines(axis):
                    members = [base + t for t in line]
                    g = dist.new_group(members)
                    if rank in members:
                        out[axis] = g
        return out

    def _pipeline_groups(self, rank: int) -> dict:
        """``pp_grad``: the pipeline ranks again, so gradients travel apart from activations (each
        direction between two ranks then carries one kind of message, in order); ``pp_ends``: the
        first and last stage (weights tied between them). Every rank creates all of them."""
        if self.pp == 1:
            return {}
        out = {}
        inner = self.dp * self.cp * self.tp
        for base in range(inner):
            members = [base + i * inner for i in range(self.pp)]
            grads = dist.new_group(members)
            ends = dist.new_group([members[0], members[-1]])
            if rank in members:
                out["pp_grad"] = grads
            if rank in (members[0], members[-1]):
                out["pp_ends"] = ends
        return out

    def _replica_members(self):
        """For every (pp, tp) coordinate, the dp x cp ranks sharing it (they hold the same weights)."""
        for pp_i in range(self.pp):
            for tp_i in range(self.tp):
                yield [
                    ((pp_i * self.dp + d) * self.cp + c) * self.tp + tp_i
                    for d in range(self.dp)
                    for c in range(self.cp)
                ]

    def _data_group(self, rank: int):
        """``dp_cp``: the dp x cp ranks of one (pp, tp) coordinate, which average gradients together
        (context-parallel ranks hold the same weights as data-parallel ones); every rank creates all."""
        if self.cp == 1:
            return None
        mine = None
        for members in self._replica_members():
            g = dist.new_group(members)
            if rank in members:
                mine = g
        return mine

    def _ep_group(self, rank: int):
        """Expert groups: blocks of ``ep`` among the dp x cp ranks sharing (pp, tp); every rank creates all."""
        if self.ep == 1:
            return None
        mine = None
        for members in self._replica_members():
            for start in range(0, len(members), self.ep):
                block = members[start : start + self.ep]
                g = dist.new_group(block)
                if rank in block:
                    mine = g
        return mine

    def _expert_data_group(self, rank: int):
        """``edp``: the ranks holding the same experts -- the same position in each ``ep`` block of a
        replica group (``R / ep`` ranks); every rank creates all."""
        if self.ep == 1:
            return None
        mine = None
        for members in self._replica_members():
            for j in range(self.ep):
                block = members[j :: self.ep]
                g = dist.new_group(block)
                if rank in block:
                    mine = g
        return mine


class Topology:
    """The built layout: this rank's coordinates, device, and one :class:`GroupComm` per dimension."""

    def __init__(self, dims: ParallelDims, mesh, device: torch.device, groups: dict):
        self.dims = dims
        self.mesh = mesh
        self.device = device
        self.ledger = CommLedger()
        self.rank = dist.get_rank() if mesh is not None else 0
        self.world_size = dims.world_size
        self.coords = dims.coords(self.rank)
        self._comms = {
            name: GroupComm(name, groups.get(name), self.ledger)
            for name in (*MESH_DIMS, "ep", "edp", "pp_grad", "pp_ends", "dp_cp", *GRID_AXES)
        }
        self._comms["world"] = GroupComm("world", dist.group.WORLD if mesh is not None else None, self.ledger)

    def comm(self, name: str) -> GroupComm:
        """The communicator of dimension ``name`` (``dp``, ``tp``, ``pp``, ``cp``, ``ep`` or ``world``; with
        pipeline stages also ``pp_grad`` and ``pp_ends``, see :meth:`ParallelDims._pipeline_groups`; with
        context parallelism ``dp_cp``, see :meth:`replicas`; with a tensor-parallel grid ``tp_row``, ``tp_col``,
        ``tp_dep``, see :class:`TPGrid`)."""
        return self._comms[name]

    def size(self, name: str) -> int:
        return self._comms[name].size

    def replicas(self) -> GroupComm:
        """The ranks holding the same weights, which average their gradients (and ZeRO shards them over): ``dp``,
        or with context parallelism the combined ``dp x cp`` group (``dp_cp``). (With expert parallelism they hold
        the same weights except their experts: those over :meth:`expert_group`.)"""
        return self._comms["dp_cp"] if self.dims.cp > 1 else self._comms["dp"]

    def expert_group(self) -> GroupComm:
        """The ranks holding the same experts (``edp``, the data-parallel group of the experts; see
        :mod:`trickles.parallel.expert`): :meth:`replicas` without expert parallelism."""
        return self._comms["edp"] if self.dims.ep > 1 else self.replicas()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        c = ", ".join(f"{k}={v}/{self.size(k)}" for k, v in self.coords.items())
        return f"Topology(rank={self.rank}, {c}, device={self.device})"


@contextmanager
def distributed_session(
    dims: ParallelDims | None = None, device: str | torch.device = "auto", timeout_s: float | None = None
):
    """Initializes the process group from the environment, yields a :class:`Topology`, tears down cleanly.

    ``timeout_s``: with several ranks, a :class:`~trickles.watchdog.Watchdog` ends the job (every
    rank reporting where it is) when a communication call takes longer; the process group's own
    timeout is the watchdog's backstop. On an exception the group is left for the launcher to
    tear down (a barrier could hang).
    """
    dev = device if isinstance(device, torch.device) else select_device(device)
    init_distributed(dev, backstop_timeout(timeout_s).total_seconds() if timeout_s else None)
    dims = dims or ParallelDims(dp=env_world_size())
    topo = dims.build(dev)
    watchdog = None
    if timeout_s and topo.world_size > 1:
        where = ", ".join(f"{k} {v}/{topo.size(k)}" for k, v in topo.coords.items() if topo.size(k) > 1)
        watchdog = Watchdog(timeout_s, topo.rank, where).start()
    yield topo
    del topo
    shutdown_distributed()
    if watchdog is not None:
        watchdog.stop()
