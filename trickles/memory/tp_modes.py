"""What one tensor-parallel rank holds, and the four ways of splitting ``tp`` ranks side by side.

:func:`shard_meta` applies the configured tensor-parallel plan (1-D: :mod:`~trickles.parallel.tensor.plan`; a grid:
:mod:`~trickles.parallel.tensor.grid_plan`) to a model on the meta device, so the memory report counts the parameters
one rank holds on the engine's own layout. :func:`compare_tp_modes` puts 1-D, 2-D, 2.5-D and 3-D at the run's ``tp``
side by side (1-D with and without sequence parallelism) -- per rank: the weights, the model states (weights, gradients,
optimizer state, as the run's ZeRO stage and precision hold them), one micro-batch's saved activations and the bytes
sent over the tensor-parallel groups in a training step -- all from the formulas of
:mod:`trickles.parallel.tensor.costs` (which the tests hold equal to the ledger and the saved-tensor hooks). A mode the
run cannot use (``tp`` not ``q^2``, ``q^2 d`` or ``q^3``; a width, head count or micro-batch the grid does not divide)
shows ``-`` and why, in the configuration's own words. 2.5-D takes the run's ``parallel.tp_depth`` when it is the
configured mode, else the largest ``q`` with ``q^2 d = tp``, ``d >= 2`` (at ``d = 1`` it is 2-D).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..config import Config
from ..errors import ConfigError
from ..models.config import ModelConfig
from ..parallel.tensor.activation_costs import activation_bytes_nd
from ..parallel.tensor.costs import param_count, step_comm
from ..parallel.tensor.layout import Layout
from ..topology import ParallelDims
from .lora_activations import with_lora
from .precision import policy
from .states import engine_state_bytes
from .table import _fmt

#: the rows: each mode, 1-D also with sequence parallelism (which splits what a grid splits outside the matmuls)
VARIANTS = (("1d", False), ("1d", True), ("2d", False), ("2.5d", False), ("3d", False))
NAMES = {"1d": "1-D", "2d": "2-D", "2.5d": "2.5-D", "3d": "3-D"}


def shard_meta(meta, dims: ParallelDims, sequence_parallel: bool = False):
    """Applies ``dims``' tensor-parallel plan to ``meta`` (a meta-device model) as tp rank 0 holds it; returns it."""
    if dims.tp == 1:
        return meta
    if dims.tp_mode == "1d":
        from ..parallel.tensor.plan import apply_tensor_parallel

        apply_tensor_parallel(meta, SimpleNamespace(size=dims.tp, rank=0), sequence_parallel)
        return meta
    from ..parallel.tensor.grid_model import GridContext
    from ..parallel.tensor.grid_plan import apply_tensor_nd

    grid = dims.grid

    def group(n):  # (the plan reads sizes and ranks; the meta model never talks)
        return SimpleNamespace(size=n, rank=0)

    apply_tensor_nd(
        meta,
        GridContext(grid, group(dims.tp), group(grid.q), group(grid.q), group(grid.depth) if grid.depth > 1 else None),
    )
    return meta


def activations(cfg: Config, model_cfg: ModelConfig, lay: Layout, dims: ParallelDims, device_type: str = "cpu") -> dict:
    """One micro-batch's saved activations on a rank of ``lay`` (:func:`~trickles.memory.activations.activation_bytes`'s
    keys): 1-D with the run's context and expert parallelism and loss; a grid from
    :func:`~trickles.parallel.tensor.activation_costs.activation_bytes_nd`."""
    from ..kernels.cross_entropy import fused_on
    from .activations import activation_bytes

    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    p = torch.finfo(prec.param_dtype).bits // 8
    micro, _ = cfg.batch_plan(dims.dp)
    if lay.grid:
        return activation_bytes_nd(model_cfg, lay, micro, cfg.data.seq_len, p, cfg.memory.recompute, device_type)

    def one(mode: str) -> dict:  # (a LoRA run's: trickles.memory.lora_activations)
        return with_lora(full(mode), cfg, model_cfg, lay, dims, device_type, mode)

    def full(mode: str) -> dict:
        return activation_bytes(
            model_cfg,
            micro,
            cfg.data.seq_len,
            mode,
            p,
            device_type,
            lay.tp,
            lay.sequence_parallel,
            dims.cp,
            cfg.parallel.cp_mode,
            dims.ep,
            fused_loss=fused_on(model_cfg.fused_loss, model_cfg.kernels, device_type),
            fp16=cfg.memory.precision == "fp16",
            documents=cfg.data.document_mask,
            expert_load=cfg.memory.expert_load,
        )

    if not cfg.memory.recompute_num_layers:
        return one(cfg.memory.recompute)
    # a partial full recomputation: each layer as its mode keeps it (the head and the tables alike in every mode,
    # but for what the first layer keeps once for all)
    modes = cfg.recompute_modes(dims)
    each = {m: one(m) for m in set(modes.values())}
    rest = each.get(cfg.memory.recompute_rest, each["full"])
    per_layer = [each[modes[i]]["per_layer"][i] for i in range(model_cfg.n_layers)]
    first = each[modes[0]]
    return dict(
        rest,
        per_layer=per_layer,
        layers=sum(per_layer) - first["tables"],
        tables=first["tables"],
        total=sum(per_layer) + rest["head"],
        rebuilt=max(a["rebuilt"] for a in each.values()),
    )


def brought_back(modes: dict[int, str], act: dict, plain: list[int] | None) -> list[int]:
    """Per layer, what its recomputation (``modes``, :meth:`~trickles.config.Config.recompute_modes`) brings back at
    once in its backward: a whole layer's or attention core's saved tensors (``full``, ``selective``: ``plain``, what
    it keeps without recomputation, less what it keeps with, ``act``), one rebuilt output (``elementwise``:
    ``act["rebuilt"]``), nothing (``none``). ``plain`` may be None where no layer is ``full`` or ``selective``."""
    return [
        0
        if modes[i] == "none"
        else act.get("rebuilt", 0)
        if modes[i] == "elementwise"
        else plain[i] - act["per_layer"][i]
        for i in range(len(act["per_layer"]))
    ]


def without_recompute(
    cfg: Config, model_cfg: ModelConfig, lay: Layout, dims: ParallelDims, device_type: str, modes: dict[int, str]
) -> list[int] | None:
    """Each layer's activations without recomputation, where a layer of ``modes`` needs them (:func:`brought_back`)."""
    if not any(m in ("full", "selective") for m in modes.values()):
        return None
    return activations(dataclasses.replace(cfg, memory=cfg.memory.uniform("none")), model_cfg, lay, dims, device_type)[
        "per_layer"
    ]


def recomputed_in_backward(brought: list[int], per_layer: list[int], layers: list[int]) -> int:
    """The most recomputation holds beyond the saved activations while a chunk of ``layers`` (in forward order) runs
    its backward: layer ``j`` brings back ``brought[j]`` once the layers after it have released theirs."""
    return max((brought[j] - sum(per_layer[k] for k in layers[n + 1 :]) for n, j in enumerate(layers)), default=0)


def depth_for(mode: str, tp: int, configured: Config) -> int:
    """The 2.5-D depth to compare at ``tp`` (module docstring); 1 for the other modes."""
    if mode != "2.5d":
        return 1
    if configured.parallel.tp_mode == "2.5d":
        return configured.parallel.tp_depth
    for q in range(int(tp**0.5), 1, -1):
        if tp % (q * q) == 0 and tp // (q * q) >= 2:
            return tp // (q * q)
    return 0


@dataclass
class ModeRow:
    """One mode's costs per rank (bytes), or why the run cannot use it."""

    mode: str
    sequence_parallel: bool = False
    layout: str = ""
    weights: float | None = None
    states: float | None = None
    activations: float | None = None
    comm: float | None = None
    why: str = ""
    configured: bool = False


@dataclass
class ModeTable:
    """:func:`compare_tp_modes`'s rows; :meth:`table` prints them."""

    tp: int
    rows: list[ModeRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, mode: str, sequence_parallel: bool = False) -> ModeRow:
        return next(r for r in self.rows if r.mode == mode and r.sequence_parallel == sequence_parallel)

    def table(self) -> str:
        base = self.row("1d").comm
        head = (
            f"{'tp=' + str(self.tp):<8}{'layout':<14}{'weights':>13}{'model states':>14}{'activations':>13}"
            f"{'tp comm/step':>14}{'vs 1-D':>8}"
        )
        lines = [
            f"tensor-parallel modes at tp={self.tp}, per rank (* this run; formulas of trickles.parallel.tensor.costs)",
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            name = NAMES[r.mode] + ("+SP" if r.sequence_parallel else "") + ("*" if r.configured else "")
            if r.why:
                lines.append(f"{name:<8}- {r.why}")
                continue
            ratio = f"{r.comm / base:.2f}" if base else "-"
            lines.append(
                f"{name:<8}{r.layout:<14}{_fmt(r.weights):>13}{_fmt(r.states):>14}{_fmt(r.activations):>13}"
                f"{_fmt(r.comm):>14}{ratio:>8}"
            )
        lines.extend(f"  {n}" for n in self.notes)
        return "\n".join(lines)


def compare_tp_modes(cfg: Config, dims: ParallelDims, model_cfg: ModelConfig, device_type: str = "cpu") -> ModeTable:
    """The four modes at ``dims.tp`` for ``cfg``'s model, batch and precision (module docstring)."""
    from ..models.transformer import Transformer

    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    p = torch.finfo(prec.param_dtype).bits // 8
    g = torch.finfo(prec.grad_dtype).bits // 8
    micro, accumulation = cfg.batch_plan(dims.dp)
    seq, recompute = cfg.data.seq_len, cfg.memory.recompute
    whole = sum(m == "full" for m in cfg.recompute_modes(dims).values())  # blocks recomputed whole
    out = ModeTable(dims.tp)
    for mode, sp in VARIANTS:
        row = ModeRow(mode, sp, configured=mode == dims.tp_mode and sp == cfg.parallel.sequence_parallel)
        out.rows.append(row)
        depth = depth_for(mode, dims.tp, cfg)
        if depth == 0:
            row.why = f"tp={dims.tp} is not q^2 x d with q, d >= 2 (2.5-D at d = 1 is 2-D)"
            continue
        par = dataclasses.replace(cfg.parallel, tp_mode=mode, tp_depth=depth, sequence_parallel=sp)
        try:
            alt = dataclasses.replace(cfg, parallel=par).validate(dims.world_size)
            lay = Layout.of(mode, dims.tp, depth, sp)
        except ConfigError as e:
            row.why = str(e)
            continue
        row.layout = (f"q={lay.q}" + (f", d={lay.depth}" if mode == "2.5d" else "")) if lay.grid else "Megatron"
        row.weights = p * param_count(model_cfg, lay)["total"]
        with torch.device("meta"):
            meta = shard_meta(Transformer(model_cfg), alt, sp)
        states = engine_state_bytes(meta.to(prec.param_dtype), cfg, dims.dp * dims.cp, 0, None, cfg.accumulates(dims))
        row.states = (
            states["parameters"] + states["gradients"] + (0 if cfg.memory.offload_optimizer else states["optimizer"])
        )
        row.activations = activations(cfg, model_cfg, lay, dims, device_type)["total"]
        row.comm = step_comm(model_cfg, lay, micro, seq, p, accumulation, recompute, g, whole=whole)
    out.notes.append(
        f"micro-batch {micro} x {seq} tokens, {accumulation} per step, {cfg.memory.precision}, recompute "
        f"{cfg.memory.describe()}; activations: one micro-batch's, all layers and the head"
    )
    out.notes.append(
        "tp comm: what one rank sends over its tensor-parallel groups (ring algorithms) in the forward and "
        "backward of every micro-batch, and the gradient norm"
    )
    return out


__all__ = ["VARIANTS", "ModeRow", "ModeTable", "activations", "compare_tp_modes", "depth_for", "shard_meta"]
