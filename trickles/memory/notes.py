"""The lines under the memory report's table: the layout the numbers are for, and what they assume or leave out.

:func:`describe` adds, after :func:`~trickles.memory.report.predict` has the numbers: one line with the model's size
and the layout (data, tensor -- 1-D or a grid, with the parameters per rank -- and context parallelism, the ZeRO
stage, the precisions, the micro-batch, the recomputation, a fused loss); the pipeline's lines ``predict`` made;
then one line for each assumption that applies: an asynchronous save's host copies, a tensor-parallel grid's
dropout masks (not counted), an offloaded optimizer (host memory, outside held and peak) and a mixture of experts
(experts per block and rank, active parameters, how ZeRO shards them, the balanced load and capacity's upper bound
the prediction assumes).
"""

from __future__ import annotations

from ..config import Config
from ..models.config import ModelConfig
from ..parallel.tensor.layout import Layout
from ..topology import ParallelDims
from .table import MemoryReport, _fmt


def describe(
    report: MemoryReport,
    cfg: Config,
    dims: ParallelDims,
    model_cfg: ModelConfig,
    lay: Layout,
    n: int,
    total_params: int,
    active_params: int,
    fused: bool,
    notes: list[str],
) -> None:
    """Appends the notes of the module docstring to ``report.notes``: ``n`` the parameters on the reported rank,
    ``total_params`` / ``active_params`` the model's (all, and those a token uses), ``fused`` whether the loss is
    fused, ``notes`` the pipeline's lines (after the layout's)."""
    micro, _ = cfg.batch_plan(dims.dp)
    edp = dims.dp * dims.cp // dims.ep
    mode = f" {lay.mode} (q={lay.q}{f', d={lay.depth}' if lay.mode == '2.5d' else ''})" if lay.grid else ""
    sp = " with sequence parallel" if cfg.parallel.sequence_parallel else ""
    tp = f", tp={dims.tp}{mode}{sp} ({n / 1e6:.1f}M per rank)" if dims.tp > 1 else ""
    tp += (
        f", cp={dims.cp} ({cfg.parallel.cp_mode}, {cfg.data.seq_len // dims.cp} tokens of each sequence per rank)"
        if dims.cp > 1
        else ""
    )
    report.notes.append(
        f"{total_params / 1e6:.1f}M parameters, dp={dims.dp}{tp}, ZeRO-{cfg.parallel.zero}, "
        f"{cfg.memory.precision} (gradients {cfg.memory.grad_dtype}), "
        f"micro-batch {micro} x {cfg.data.seq_len}, recompute {cfg.memory.describe()}"
        + (", fused loss (no [tokens, vocab] logits)" if fused else "")
    )
    report.notes.extend(notes)
    if cfg.train.async_checkpoint:
        report.notes.append(
            f"train.async_checkpoint: a save in flight holds {_fmt(report.predicted['checkpoint_host'])} of "
            "host copies on this rank (the tensors it writes), beside the device memory above"
        )
    if model_cfg.dropout > 0 and lay.grid:
        report.notes.append(f"model.dropout={model_cfg.dropout:g}: the masks of a tensor-parallel grid are not counted")
    if cfg.memory.offload_optimizer:
        report.notes.append(
            "memory.offload_optimizer: the optimizer state (fp32 master weights, fp32 gradient copy, "
            "moments) is in host memory; held and peak count the device only"
        )
    if model_cfg.moe_experts:
        mc = model_cfg
        note = (
            f"mixture of experts in {len(mc.moe_layers)} of {mc.n_layers} blocks: {mc.moe_experts} experts, "
            f"top-{mc.moe_top_k}{f' + {mc.moe_shared_experts} shared' if mc.moe_shared_experts else ''}; "
            f"{total_params / 1e6:.2f}M parameters in all, "
            f"{active_params / 1e6:.2f}M active per token"
        )
        if dims.ep > 1:
            note += (
                f"; ep={dims.ep}: {mc.moe_experts // dims.ep} experts per rank ({n / 1e6:.2f}M parameters), "
                f"ZeRO shards the experts over the {edp} rank{'s' if edp > 1 else ''} holding the same ones (edp) "
                "and the rest over all "
                f"{dims.dp * dims.cp}; the experts' activations and the "
                f"all-to-all rows in flight for a balanced load"
            )
        if mc.moe_capacity_factor > 0:
            note += (
                f"; capacity factor {mc.moe_capacity_factor:g}: expert activations are an upper bound "
                "(every expert full)"
            )
        report.notes.append(note)
