"""Where the memory goes: predicted bytes per device, and measured ones, side by side.

:func:`predict` works from the configuration alone (no process group, no device): model
states from the ZeRO formulas for the layout and precision (``accounting.py``), counted on the
engine's padded flat layout (:func:`engine_state_bytes`, exact to the byte), activations
per layer from the formulas of this implementation (``activations.py``), and an estimated
peak. :func:`measure` builds the real trainer, runs a few steps and reads the same categories
back: parameters, gradients and optimizer state from the tensors the data-parallel engine
holds (which are all the live tensors), activations with saved-tensor hooks over one
micro-batch, and the peak: on CUDA the allocator's, on a CPU the model states plus the most the last step
allocates above them (:func:`~trickles.memory.accounting.peak_allocated`, from the profiler's record). :func:`report` puts both in a table, a bar
chart PNG and an answer to "does this fit in X GB".

``held`` = model states on the device + all saved activations of one micro-batch (what is
alive at the end of forward); predicted ``peak`` = ``held`` + transients: the fp32 gradients of
the log-probabilities and of the logits (``8sV``, alive together in the loss's backward; ``4sV/tp``
for the vocabulary-parallel loss, which reuses its saved probabilities; with ``model.fused_loss``
one chunk's logits instead, :func:`~trickles.memory.activations.loss_transient_bytes`), ring attention's key/value blocks
in flight, expert parallelism's rows in flight (``2 p m d``: the rows one all-to-all sends and receives, ``m``
the assignments of the rank's tokens, :func:`expert_rows_in_flight`) and buffers (ZeRO-2, and ZeRO-1 without accumulation: two gradient
buckets; ZeRO-3: the root and two gathered blocks). On CUDA the measured peak is the
allocator's ``max_memory_allocated``.

Tensor parallelism: the plan of ``parallel.tp_mode`` (1-D, or a 2-D/2.5-D/3-D grid) applied to the meta model gives
the parameters a rank holds; a grid's activations and loss transient come from
:mod:`trickles.parallel.tensor_nd_costs`. At ``tp > 1`` the report ends with 1-D (with and without sequence
parallelism), 2-D, 2.5-D and 3-D side by side (:func:`~trickles.memory.tp_modes.compare_tp_modes`).

Mixture-of-experts models: each MoE block's activations have their own formula
(:mod:`~trickles.memory.activations`); with expert parallelism (``parallel.ep``) a rank holds ``E / ep`` experts
of every block (the plan's :func:`~trickles.parallel.expert.apply_expert_parallel` applied to the meta model)
and ZeRO shards the experts over their ``edp`` group, the ``dp x cp / ep`` ranks holding the same experts
(:meth:`~trickles.topology.Topology.expert_group`), and every other weight over all ``dp x cp`` replicas.
What a rank's experts receive depends on the routing:
the prediction is for a balanced load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..config import Config
from ..errors import ConfigError
from ..models.config import ModelConfig, resolve_model
from ..topology import ParallelDims
from ..kernels import runs_triton
from ..kernels.cross_entropy import fused_on
from ..parallel.tensor_nd_costs import Layout, loss_transient_nd
from .accounting import peak_allocated
from .activations import ActivationMeter, loss_transient_bytes
from .precision import policy
from .tp_modes import activations, compare_tp_modes, shard_meta

GiB = 2**30


@dataclass
class MemoryReport:
    """Bytes per device by category; ``measured`` is empty until :func:`measure` fills it."""

    predicted: dict[str, float]
    layers_predicted: list[int]
    measured: dict[str, float] = field(default_factory=dict)
    layers_measured: list[int] = field(default_factory=list)
    host_optimizer: bool = False
    notes: list[str] = field(default_factory=list)
    moe_layers: list[int] = field(default_factory=list)  # which layers are mixture-of-experts blocks
    tp_modes: str = ""  # the tensor-parallel modes at this tp, side by side (tp_modes.compare_tp_modes)

    CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "head", "held", "transient", "peak")

    def table(self, device_gb: float | None = None) -> str:
        has_m = bool(self.measured)
        head = f"{'category':<14}{'predicted':>14}" + (f"{'measured':>14}{'meas/pred':>11}" if has_m else "")
        lines = [head, "-" * len(head)]
        for c in self.CATEGORIES:
            name = c + (" (host)" if c == "optimizer" and self.host_optimizer else "")
            row = f"{name:<14}{_fmt(self.predicted.get(c)):>14}"
            if has_m:
                m = self.measured.get(c)
                ratio = f"{m / self.predicted[c]:.3f}" if m is not None and self.predicted.get(c) else "-"
                row += f"{_fmt(m):>14}{ratio:>11}"
            lines.append(row)
        if self.layers_predicted and not self.layers_measured:
            lines.append("")
            lines.extend(self._layer_summary())
        elif self.layers_predicted:
            lines.append("")
            lines.append(f"{'per layer':<14}{'predicted':>14}" + (f"{'measured':>14}" if self.layers_measured else ""))
            for i, pl in enumerate(self.layers_predicted):
                ml = self.layers_measured[i] if i < len(self.layers_measured) else None
                name = f"layer {i}" + (" (MoE)" if i in self.moe_layers else "")
                lines.append(f"{name:<14}{_fmt(pl):>14}" + (f"{_fmt(ml):>14}" if self.layers_measured else ""))
        if device_gb is not None:
            peak = max(self.measured.get("peak") or 0, self.predicted["peak"])
            cap = device_gb * 1e9
            verdict = "fits" if peak <= 0.9 * cap else ("tight" if peak <= cap else "does NOT fit")
            lines.append("")
            lines.append(f"device of {device_gb:g} GB: peak {_fmt(peak)} is {100 * peak / cap:.0f}% of it -> {verdict}"
                         + (" (keep 10% for the allocator and the framework)" if verdict == "tight" else ""))
        lines.extend(f"note: {n}" for n in self.notes)
        if self.tp_modes:
            lines.extend(["", self.tp_modes])
        return "\n".join(lines)

    def _layer_summary(self) -> list[str]:
        """One line per kind of layer (dense, mixture of experts): what each keeps; the first layer apart when it
        keeps more (context parallel llama in fp32: the gathered rotary tables)."""
        moe = set(self.moe_layers)
        lines = []
        for kind in ("dense", "mixture-of-experts"):
            idx = [i for i in range(len(self.layers_predicted)) if (i in moe) == (kind != "dense")]
            if not idx:
                continue
            label = f" {kind}" if moe else ""
            first, rest = self.layers_predicted[idx[0]], [self.layers_predicted[i] for i in idx[1:]]
            if all(x == first for x in rest):
                lines.append(f"each of the {len(idx)}{label} layers: {_fmt(first)} of saved activations")
            else:
                lines.append(f"layer {idx[0]}: {_fmt(first)}, each of the other {len(rest)}{label}: {_fmt(rest[0])} of saved activations")
        return lines

    def plot(self, path: str) -> bool:
        """Bar chart of predicted (and measured) bytes per category; False without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        cats = [c for c in self.CATEGORIES if self.predicted.get(c)]
        top = max(max(self.predicted.values()), max(self.measured.values(), default=0))
        unit, size = ("GiB", GiB) if top >= GiB else ("MiB", 2**20)
        x = range(len(cats))
        fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
        w = 0.4 if self.measured else 0.8
        ax.bar([i - (w / 2 if self.measured else 0) for i in x], [self.predicted[c] / size for c in cats], w, label="predicted")
        if self.measured:
            ax.bar([i + w / 2 for i in x], [(self.measured.get(c) or 0) / size for c in cats], w, label="measured")
        ax.set_xticks(list(x))
        ax.set_xticklabels(cats)
        ax.set_ylabel(f"{unit} per device")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return True


def _fmt(v) -> str:
    if v is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            return f"{v / size:,.2f} {unit}"
    return f"{v:,.0f} B"


def predict(cfg: Config, dims: ParallelDims, model_cfg: ModelConfig, device_type: str = "cpu", dp_rank: int = 0) -> MemoryReport:
    """The memory one device needs for ``cfg`` at ``dims`` (``model_cfg`` fully resolved): the device of
    data-parallel rank ``dp_rank`` (ranks differ by a few bytes under ZeRO >= 1: the segments each owns; with
    context parallelism the rank in the ``dp x cp`` group, :meth:`~trickles.topology.Topology.replicas`; with
    expert parallelism that rank's experts and its place, ``dp_rank // ep``, in its ``edp`` group)."""
    from ..models.transformer import Transformer, count_params

    if dims.pp > 1:
        raise ConfigError("the memory report does not model pipeline stages yet (each holds its layers and up to pp "
                          "micro-batches' activations under 1F1B); run it with parallel.pp=1")

    with torch.device("meta"):
        meta = Transformer(model_cfg)
    total_params = count_params(meta)
    active_params = total_params - _idle_expert_params(meta)
    if dims.ep > 1:  # this rank's E / ep experts of every MoE block, in the order the plan applies them
        from ..parallel.expert import apply_expert_parallel

        # (the dispatch it installs would talk over the ep group; the meta model never runs it)
        apply_expert_parallel(meta, SimpleNamespace(size=dims.ep, rank=dp_rank % dims.ep))
    shard_meta(meta, dims, cfg.parallel.sequence_parallel)  # what one tensor-parallel rank holds (1-D or a grid)
    n = count_params(meta)
    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    p = torch.finfo(prec.param_dtype).bits // 8
    g = torch.finfo(prec.grad_dtype).bits // 8
    offload = cfg.memory.offload_optimizer
    stage = cfg.parallel.zero
    # the weights are replicated over dp x cp ranks: ZeRO shards over all of them (dp_rank counts them); with expert
    # parallelism the experts over edp, the R / ep ranks holding the same experts (Topology.expert_group):
    # replica r is rank r // ep of its edp group
    edp = dims.dp * dims.cp // dims.ep
    accumulates = cfg.accumulates(dims)
    states = engine_state_bytes(meta.to(prec.param_dtype), cfg, dims.dp * dims.cp, dp_rank,
                                (edp, dp_rank // dims.ep) if dims.ep > 1 else None, accumulates)
    micro, _ = cfg.batch_plan(dims.dp)
    triton = runs_triton(model_cfg.kernels, device_type)
    fused = fused_on(model_cfg.fused_loss, model_cfg.kernels, device_type)
    lay = Layout.of(dims.tp_mode, dims.tp, dims.tp_depth, cfg.parallel.sequence_parallel)
    act = activations(cfg, model_cfg, lay, dims, device_type)
    tokens = micro * cfg.data.seq_len // dims.cp  # this rank's tokens of a micro-batch
    # the loss: unfused, its backward's fp32 gradients; fused, one chunk's logits
    transient = (loss_transient_nd(model_cfg, lay, micro, cfg.data.seq_len) if lay.grid
                 else loss_transient_bytes(model_cfg, tokens, p, dims.tp, fused, triton))
    if dims.cp > 1 and cfg.parallel.cp_mode == "ring":
        transient += ring_blocks_in_flight(model_cfg, tokens, p, dims.tp)
    if dims.ep > 1 and model_cfg.moe_layers:
        routed = tokens // dims.tp if cfg.parallel.sequence_parallel and dims.tp > 1 else tokens
        transient += expert_rows_in_flight(model_cfg, micro, routed // micro, cfg.data.seq_len, p)
    if stage == 2 or (stage == 1 and not accumulates):  # bucket buffers filling and in flight
        bucket = (cfg.parallel.bucket_mb * 2**20) if cfg.parallel.bucket_mb > 0 else n * g
        transient += 2 * min(bucket, n * g)
    if stage == 3:
        root = _root_params(meta)
        transient += p * (root + 2 * (n - root) / model_cfg.n_layers)
    device_states = states["parameters"] + states["gradients"] + (0 if offload else states["optimizer"])
    predicted = {"parameters": states["parameters"], "gradients": states["gradients"], "optimizer": states["optimizer"],
                 "activations": sum(act["per_layer"]), "head": act["head"], "transient": transient}
    predicted["held"] = device_states + act["total"]
    predicted["peak"] = predicted["held"] + transient
    report = MemoryReport(predicted, list(act["per_layer"]), host_optimizer=offload, moe_layers=list(model_cfg.moe_layers))
    mode = f" {lay.mode} (q={lay.q}{f', d={lay.depth}' if lay.mode == '2.5d' else ''})" if lay.grid else ""
    tp = f", tp={dims.tp}{mode}{' with sequence parallel' if cfg.parallel.sequence_parallel else ''} ({n / 1e6:.1f}M per rank)" if dims.tp > 1 else ""
    tp += f", cp={dims.cp} ({cfg.parallel.cp_mode}, {cfg.data.seq_len // dims.cp} tokens of each sequence per rank)" if dims.cp > 1 else ""
    report.notes.append(f"{total_params / 1e6:.1f}M parameters, dp={dims.dp}{tp}, ZeRO-{stage}, {cfg.memory.precision} (gradients {cfg.memory.grad_dtype}), "
                        f"micro-batch {micro} x {cfg.data.seq_len}, recompute {cfg.memory.recompute}"
                        + (", fused loss (no [tokens, vocab] logits)" if fused else ""))
    if model_cfg.moe_experts:
        mc = model_cfg
        note = (f"mixture of experts in {len(mc.moe_layers)} of {mc.n_layers} blocks: {mc.moe_experts} experts, top-{mc.moe_top_k}"
                f"{f' + {mc.moe_shared_experts} shared' if mc.moe_shared_experts else ''}; {total_params / 1e6:.2f}M parameters in all, "
                f"{active_params / 1e6:.2f}M active per token")
        if dims.ep > 1:
            note += (f"; ep={dims.ep}: {mc.moe_experts // dims.ep} experts per rank ({n / 1e6:.2f}M parameters), ZeRO shards the "
                     f"experts over the {edp} rank{'s' if edp > 1 else ''} holding the same ones (edp) and the rest over all "
                     f"{dims.dp * dims.cp}; the experts' activations and the "
                     f"all-to-all rows in flight for a balanced load")
        if mc.moe_capacity_factor > 0:
            note += f"; capacity factor {mc.moe_capacity_factor:g}: expert activations are an upper bound (every expert full)"
        report.notes.append(note)
    return report


def _idle_expert_params(model) -> int:
    """Parameters a token does not pass through: the ``E - k`` routed experts it is not sent to, in every MoE block."""
    from ..models.moe import MoE

    idle = 0
    for block in model.layers.values():
        if isinstance(block.mlp, MoE):
            ex = block.mlp.experts
            per_expert = sum(prm.numel() for prm in ex.parameters()) // ex.count
            idle += (ex.count - block.mlp.top_k) * per_expert
    return idle


def expert_rows_in_flight(cfg: ModelConfig, batch: int, tokens: int, seq: int, p: int) -> int:
    """Expert parallelism's rows alive at once beyond the saved activations, in one MoE block (one at a time):
    ``2 p m d`` with ``m`` the assignments of the rank's ``batch x tokens`` routed tokens
    (:func:`~trickles.memory.activations.moe_assignments`; balanced, each rank receiving what it sends). Forward,
    the first all-to-all holds the gathered rows sent and the rows received; the second the received rows (still
    referenced by the dispatch) and the outputs being sent back (those that arrive are saved). Backward, each
    all-to-all holds the gradient rows sent and those received: ``2 p m d`` in every case
    (:func:`~trickles.parallel.expert.expert_dispatch`)."""
    from .activations import moe_assignments

    return 2 * p * moe_assignments(cfg, batch, tokens, seq) * cfg.d_model


def ring_blocks_in_flight(cfg: ModelConfig, tokens: int, p: int, tp: int = 1) -> int:
    """Ring attention's key/value blocks alive at once beyond the saved activations, for ``tokens`` of this
    rank (one layer at a time): in backward the block held and the one arriving (``2 x 2 s a_kv h p``)
    and two fp32 gradient blocks, the one being sent on and the one arriving (``2 x 2 s a_kv h 4``);
    forward holds only the two key/value blocks."""
    kv = cfg.kv_heads // tp if cfg.kv_heads % tp == 0 else cfg.n_heads // tp
    block = 2 * tokens * kv * cfg.head_dim
    return 2 * block * p + 2 * block * 4


def engine_state_bytes(meta, cfg: Config, dp: int, dp_rank: int = 0, experts: tuple[int, int] | None = None,
                       accumulates: bool = True) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that data-parallel rank ``dp_rank`` holds between steps.

    ``meta`` is the (tensor-parallel) model on the meta device, in the parameters' type. These are
    the ZeRO formulas (:func:`~trickles.memory.accounting.zero_model_state_bytes`) with ``p``, ``g``
    bytes per parameter and gradient and ``k`` of optimizer state (Adam's or LAMB's moments 8, LARS's or SGD's
    momentum 4, plain SGD 0; fp32 master
    weights apart from low-precision or offloaded parameters 4; an fp32 copy of low-precision or
    offloaded gradients 4), counted on the engine's real layout: flat buffers padded per bucket to a
    multiple of ``16 dp`` elements (:class:`~trickles.parallel.flat.FlatLayout`; under ZeRO-3 one
    bucket per block and one for the root), and (AdamW, LAMB) a 4-byte step counter per owned parameter segment.
    ``experts``: with expert parallelism, the size of the experts' ``edp`` group and the rank's place in it (the
    experts then form buckets of their own, under ZeRO-3 a unit per block, sharded over it). ``accumulates``: a step
    adds up several micro-batches' gradients (stage 1 then keeps the full gradient buffer; otherwise it holds its shard,
    as stage 2 does).
    """
    from ..optim.settings import OptimizerSettings
    from ..parallel.engine import FIRST_BUCKET_BYTES, _spec, bucket_bytes, unique_named_parameters
    from ..parallel.flat import FlatLayout

    prec = policy(cfg.memory.precision, cfg.memory.grad_dtype)
    p = torch.finfo(prec.param_dtype).bits // 8
    g = torch.finfo(prec.grad_dtype).bits // 8
    offload = cfg.memory.offload_optimizer
    settings = OptimizerSettings.from_train(cfg.train)
    k = 4 * len(settings.state_keys) + (4 if prec.low or offload else 0) + (4 if g != 4 or offload else 0)
    stage = cfg.parallel.zero
    worlds, ranks = ([dp], [dp_rank]) if experts is None else ([dp, experts[0]], [dp_rank, experts[1]])
    if stage == 3:
        from ..parallel.expert import expert_modules
        from ..parallel.zero3 import _owned

        names = {id(m): name for name, m in meta.named_modules()}
        expert_units = expert_modules(meta) if experts is not None else []
        units = [*meta.layers.values(), *expert_units, meta]
        unit_ids = {id(m) for m in units}
        group = [1 if any(m is e for e in expert_units) else 0 for m in units]
        layouts = [FlatLayout(_owned(m, names[id(m)], unit_ids - {id(m)})[0], worlds[gi], None) for m, gi in zip(units, group)]
        shard = sum(lay.shard_numel for lay in layouts)
        params, grads = p * shard, g * shard
        segments = [seg for lay, gi in zip(layouts, group) for seg in lay.segments(ranks[gi])]
    else:
        layout = FlatLayout(unique_named_parameters(meta), worlds, bucket_bytes(cfg.parallel.bucket_mb),
                            first_bucket_bytes=FIRST_BUCKET_BYTES,
                            group_of=lambda t: int(experts is not None and _spec(t, "ep_sharded")))
        params = p * (layout.numel if stage == 0 else layout.total)  # ZeRO-1/2: parameters are views of a padded flat buffer
        sharded = stage == 2 or (stage == 1 and not accumulates)  # stage 1 reduces like stage 2 unless it accumulates
        grads = g * (layout.shard_numel if sharded else layout.total)
        segments = layout.whole_segments() if stage == 0 else layout.segments(ranks)
    optimizer = k * sum(s.numel for s in segments) + (4 * len(segments) if settings.counts_steps else 0)
    return {"parameters": params, "gradients": grads, "optimizer": optimizer}


def _root_params(model) -> int:
    layer_ids = {id(p) for blk in model.layers.values() for p in blk.parameters()}
    seen, total = set(), 0
    for prm in model.parameters():
        if id(prm) not in layer_ids and id(prm) not in seen:
            seen.add(id(prm))
            total += prm.numel()
    return total


def measure(trainer, report: MemoryReport, steps: int = 2) -> MemoryReport:
    """Runs ``steps`` training steps on ``trainer`` and fills ``report.measured`` (every rank must call it)."""
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(max(1, steps) - 1):
        trainer.train_step()
    before = trainer.engine.memory()
    _, rise = peak_allocated(trainer.train_step, device)  # CPU: every allocation of the step, from the profiler
    states = trainer.engine.memory()
    x, y = trainer._shard(trainer.train_data.micro_batches(trainer.consumed, trainer.cfg.train.global_batch, trainer.micro_batch))[0]
    exclude = getattr(trainer.engine, "gathered_storages", None)
    trainer.engine.zero_grad()
    with ActivationMeter(trainer.model, exclude=exclude) as meter:
        loss = trainer._loss(x, y)
    loss.backward()  # release the graph the way training would
    trainer.engine.finish_backward()
    trainer.engine.zero_grad()
    m = dict(states)
    m["activations"] = sum(meter.layers.values())
    m["head"] = meter.per_layer.get("head", 0)
    m["held"] = m["parameters"] + m["gradients"] + (0 if report.host_optimizer else m["optimizer"]) + m["activations"] + m["head"]
    if device.type == "cuda":
        m["peak"] = torch.cuda.max_memory_allocated(device)
    else:  # the model states held when the last step began, and the most the step allocated above them
        m["peak"] = before["parameters"] + before["gradients"] + (0 if report.host_optimizer else before["optimizer"]) + rise
        report.notes.append("CPU: the measured peak is the model states plus the most the last step allocated above them "
                            "(the profiler's record of allocations)")
    report.measured = m
    report.layers_measured = [meter.per_layer.get(f"layers.{i}", 0) for i in range(trainer.model_cfg.n_layers)]
    return report


def report_for(cfg: Config, world_size: int, measure_steps: int = 0, quiet: bool = False) -> MemoryReport:
    """Predicts (and, with ``measure_steps > 0``, measures) memory for ``cfg`` on ``world_size`` ranks.

    Measuring needs the processes of the layout (run it under ``trickles memory --nproc N`` or
    torchrun); predicting needs none.
    """
    from ..data import build_tokenizer
    from ..data.sources import iter_documents

    dims = cfg.validate(world_size)
    vocab = cfg.model.vocab_size or build_tokenizer(cfg.data, documents=lambda: iter_documents(cfg.data)).vocab_size
    model_cfg = resolve_model(cfg.model, vocab, cfg.data.seq_len)
    device_type = "cuda" if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu"
    report = predict(cfg, dims, model_cfg, device_type)
    if dims.tp > 1 and dims.cp == 1 and not model_cfg.moe_experts:  # (grids take neither)
        report.tp_modes = compare_tp_modes(cfg, dims, model_cfg, device_type).table()
    if measure_steps > 0:
        from ..topology import distributed_session
        from ..train.trainer import Trainer

        with distributed_session(dims, cfg.train.device, cfg.parallel.timeout_s) as topo:
            trainer = Trainer(cfg, topo, quiet=True)
            measure(trainer, report, measure_steps)
            del trainer
    return report


def run_report(cfg: Config, measure_steps: int, png: str | None, device_gb: float | None, world_size: int) -> None:
    """``trickles memory`` in one process (every rank of a measuring job runs it; rank 0 prints and draws)."""
    import os

    report = report_for(cfg, world_size, measure_steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if png and report.plot(png):
        report.notes.append(f"bar chart: {png}")
    print(report.table(device_gb))

