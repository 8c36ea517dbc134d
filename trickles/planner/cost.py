"""The step-time model: how long one optimizer step of a layout takes on a cluster, part by part.

:func:`step_time` evaluates every pipeline rank (a :class:`~trickles.planner.rank_plan.RankPlan`: its layers,
micro-batches, parameters and buckets) and reports the slowest, since the pipeline moves at its pace. For one rank, with
``m`` micro-batches of ``B`` sequences of ``T`` tokens per step, ``p`` / ``g`` bytes per parameter / gradient element:

**Compute.** ``t_f = sum_GEMMs 2 M N K / (peak x eff(M, N, K) x share) + E / (BW_mem x share)``: every forward GEMM of
the rank's chunks (:mod:`trickles.planner.compute`) at the fraction of the precision's dense peak the cluster achieves
for its shape (:meth:`~trickles.planner.cluster.Cluster.gemm_fraction`; the attention core's two at the fused kernel's,
:meth:`~trickles.planner.cluster.Cluster.attention_fraction`), plus its element-wise bytes ``E`` at the bandwidth such
work achieves (``Cluster.elementwise_gbps``, calibrated on the model's block; else the memory bandwidth), plus a third
of ``o`` per pass -- ``o`` the fixed cost of one block's (or the head's) forward and backward for a micro-batch,
``Cluster.pass_overhead_us`` (operator dispatch: 0 on GPUs), an MoE block ``o + o_moe``
(``Cluster.moe_pass_overhead_us``: its routing's many small operations); ``share`` is the fraction of a device a rank
gets (CPU ranks beyond the cores share them). Backward ``t_b = 2 t_f``: each GEMM's ``dx`` and ``dw`` products
(:class:`~trickles.planner.compute.Gemm`) -- in a LoRA run (``train.lora_rank``) the frozen base's ``dx`` alone,
the adapters' products added (:mod:`trickles.planner.compute_lora`), about ``t_b = t_f``; an adapter's rank-``r``
products, each ``max(2 M N K / (peak x gemm_efficiency), moved / BW_elementwise)`` (memory-bound: their bytes
``p (M K + K N + M N)`` outweigh their FLOPs). Recomputation adds, per
micro-batch, the blocks' forward (``full``), the attention core's (``selective``) or the norms' and activations'
passes each rebuilt output costs, twice under a split backward (``elementwise``,
:func:`~trickles.planner.compute.rebuilt_bytes`): ``t_rc``.
``compute = m (t_f + t_b + t_rc)``. Of ``t_b``, the weights' gradients take ``t_w`` = the forward time of the GEMMs with
a weight gradient (all but the attention core's; LoRA: the adapters'), in proportion to their FLOPs: what a zero-bubble
schedule's ``W`` moves into the bubble. Its FLOPs sum to :func:`trickles.train.flops.flops_per_token` (PaLM's
``6 N + 12 L d T`` per token, divided over the ranks; LoRA's about ``4 N``), except that
a causal kernel's attention core counts only the scores the mask and a layer's sliding window leave
(:func:`~trickles.planner.compute.causal_pairs`).

**Communication** (:mod:`trickles.planner.exposure`): each collective's time on the link its group spans, and the
part of it compute does not hide: data-parallel reductions and ZeRO gathers behind a micro-batch's backward or
forward, ring attention behind the attention core, pipeline messages but on the fill and drain; tensor-parallel,
all-to-all and expert collectives exposed whole.

**Bubble** (:mod:`trickles.parallel.pipeline.schedules`): a rank waits while the other stages fill the pipeline for its
first micro-batch and drain it after its last, one chunk of each other stage: ``bubble_r = sum_{s != r} u_s / v``,
``u_s = (compute_s + exposed tensor/context/expert communication_s) / m`` one micro-batch of stage ``s``
(:func:`_stages`).
With even stages this is ``(p - 1) / (v m)`` of the rank's own, as a fraction of the step's compute
``(p - 1) / (v m + p - 1)`` for GPipe, 1F1B and interleaved alike; with uneven ones (the output layer and loss on the
last stage) the slowest stage waits only for the lighter ones. The zero-bubble schedules fill it with ``W`` down to
``z = (t_f + t_b - 2 t_w) / (t_f + t_b)`` of that (ZB-H1 exactly; ZB-V at most, with two chunks per rank: ``v = 2``);
``z = 1/3`` when ``t_w = t_f = t_b / 2``. CPU ranks with a core each run faster while their peers wait
(``Cluster.core_contention``, :func:`_stages`).

**Optimizer step**: memory-bound, ``n (2 k + 2 p + g) / BW_mem`` for the ``n`` elements the rank updates (all
it holds, or ``1 / (dp cp)`` under ZeRO; experts ``1 / edp``; LoRA: the adapters alone) with ``k`` bytes of state
each (the memory report's). **Offload**: gradients down and parameters up the host link, ``n (g + p) / BW_host``, and
the step on the host at its memory bandwidth (shared by the node's ranks); overlapped (``memory.offload_overlap``,
ZeRO-1/2, AdamW/SGD) the copies down hide behind backward and the step and copies up behind the next forward.

``total = compute + bubble + exposed communication + optimizer + offload``. A pipeline of CPU ranks outnumbering the
cores is the exception (:func:`_shared_cores`): a waiting rank lends its core to a busy one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config
from ..errors import ConfigError
from ..models.config import ModelConfig
from ..parallel.pipeline.schedules import SPLIT
from ..topology import ParallelDims
from .cluster import Cluster
from .compute import ATTENTION, Work, attention_flops, chunk_work, rebuilt_bytes
from .compute_lora import CORE, lora_chunk_work
from .exposure import TimedTraffic, timed_traffic
from .placement import group_members, group_size, spans_nodes
from .rank_plan import RankPlan, rank_plans

IN_LAYER = ("tp", "cp", "ep")  # dimensions whose exposed communication stretches every micro-batch (and the bubble)


@dataclass
class StepTime:
    """One optimizer step of a layout, in seconds, part by part (see the module docstring)."""

    total_s: float
    compute_s: float  # forward + backward (+ recomputation) of the slowest pipeline rank, memory-bound kernels included
    recompute_s: float  # of compute_s
    elementwise_s: float  # of compute_s: the memory-bound kernels
    bubble_s: float
    bubble_fraction: float  # (p - 1) z / (v m + (p - 1) z), z = 1 but for the zero-bubble schedules
    comm_s: float  # every collective's time, as if none overlapped
    exposed_comm_s: float  # what overlapping leaves on the critical path
    comm_by_group: dict[str, float]  # group kind -> seconds of its collectives (serialized)
    exposed_by_group: dict[str, float]
    optimizer_s: float
    offload_s: float
    tokens: int  # per step
    model_flops: float  # per step, the whole model (PaLM's formula), for MFU
    devices: int
    peak_flops: float  # one device's dense peak at the run's precision
    in_layer_s: float = 0.0  # of exposed_comm_s: tensor/context/expert collectives, which stretch every micro-batch
    stage: int = 0  # the pipeline rank these parts are of (the slowest)
    stage_s: list[float] = field(default_factory=list)  # every pipeline rank's step time
    traffic: list[TimedTraffic] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bubble_scale: float = 1.0  # z: the share of the fill and drain a zero-bubble schedule leaves idle

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s

    @property
    def model_flops_per_device(self) -> float:
        """Achieved model FLOP/s per device."""
        return self.model_flops / self.total_s / self.devices

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization: achieved model FLOP/s per device over the dense peak."""
        return self.model_flops_per_device / self.peak_flops

    @property
    def comm_share(self) -> float:
        """Exposed communication as a fraction of the step."""
        return self.exposed_comm_s / self.total_s


def work_seconds(work: Work, cluster: Cluster, precision: str, share: float, bwd: bool = False) -> tuple[float, float]:
    """``(GEMM seconds, element-wise seconds)`` of ``work``'s forward on one rank getting ``share`` of a device (the
    module docstring's ``t_f`` without the pass overhead); ``bwd``: the GEMMs' backward products instead."""
    peak = cluster.peak_flops(precision) * share
    gemm = 0.0
    for gm in work.gemms:
        if gm.name == "scores":  # [T/cp, h_d] x [h_d, T]
            fraction = cluster.attention_fraction(precision, gm.m, gm.n, gm.k, (gm.m, gm.n, gm.k, gm.count))
        elif gm.name == "weighted":  # [T/cp, T] x [T, h_d]
            fraction = cluster.attention_fraction(precision, gm.m, gm.k, gm.n, (gm.m, gm.n, gm.k, gm.count))
        elif gm.moved:  # a rank-r product: on the roofline, the memory's time if longer (skinny tiles: no quantization)
            once = max(
                gm.flops / cluster.gemm_efficiency, peak * gm.moved * gm.count / (cluster.elementwise_Bps * share)
            )
            gemm += once * ((gm.dx + gm.dw) if bwd else 1.0) / peak
            continue
        else:
            fraction = cluster.gemm_fraction(precision, gm.m, gm.n, gm.k, gm.count)
        gemm += (gm.backward_flops if bwd else gm.flops) / (peak * fraction)
    return gemm, work.elementwise_bytes / (cluster.elementwise_Bps * share)


def rank_step(plan: RankPlan, cluster: Cluster, attention: str = "flash") -> StepTime:
    """The step time of one pipeline rank (module docstring), attention run by kernel ``attention``
    (:data:`~trickles.planner.compute.ATTENTION`)."""
    cfg, dims, mc = plan.cfg, plan.dims, plan.model_cfg
    precision, share, m = cfg.memory.precision, cluster.compute_share(dims.world_size), plan.micro_batches
    modes = plan.recompute
    whole = [i for i in plan.layers if modes[i] == "full"]  # the layers recomputed whole
    lora, work = cfg.train.lora(), None

    def chunk(layers: list[int], last: bool) -> Work:  # (a LoRA run's: its adapters, the base's backward dx only)
        args = (mc, dims, plan.micro, plan.seq, layers, last, plan.sp, plan.p)
        if lora is None:
            return chunk_work(*args, attention, cfg.parallel.cp_mode)
        return lora_chunk_work(*args, lora, attention, cfg.parallel.cp_mode)

    for c, layers in enumerate(plan.chunks):
        w = chunk(layers, plan.last and c == len(plan.chunks) - 1)
        work = w if work is None else work + w
    blocks = chunk(whole, False)
    gemm_f, elem_f = work_seconds(work, cluster, precision, share)
    overhead = cluster.pass_overhead_us * 1e-6 / share  # one block's (or the head's) forward + backward
    moe_layers = len(set(plan.layers) & set(mc.moe_layers))
    fixed = (
        len(plan.layers) + (1 if plan.last else 0)
    ) * overhead + moe_layers * cluster.moe_pass_overhead_us * 1e-6 / share
    gemm_b = work_seconds(work, cluster, precision, share, bwd=True)[0]  # 2 gemm_f in full training
    t_f, t_b = gemm_f + elem_f + fixed / 3, gemm_b + 2 * (elem_f + fixed / 3)
    # each layer's recomputation (memory.recompute_num_layers: the first ones whole, the rest otherwise): blocks' work
    # and passes; the rebuilt outputs' reads (a split backward reads in B and W); the attention cores' share
    count = {mode: sum(1 for i in plan.layers if modes[i] == mode) for mode in ("elementwise", "selective")}
    moe_whole = len(set(whole) & set(mc.moe_layers))
    t_rc = (
        (
            sum(work_seconds(blocks, cluster, precision, share))
            + (len(whole) * overhead + moe_whole * cluster.moe_pass_overhead_us * 1e-6 / share) / 3
        )
        if whole
        else 0.0
    )
    reads = 2 if cfg.parallel.schedule in SPLIT and dims.pp > 1 else 1
    t_rc += (
        rebuilt_bytes(mc, dims, plan.micro, plan.seq, plan.sp, plan.p)
        * count["elementwise"]
        * reads
        / (cluster.elementwise_Bps * share)
    )
    t_rc += (
        (
            gemm_f * attention_flops(work) / max(work.flops, 1.0)
            + work.attention_bytes / (cluster.elementwise_Bps * share)
        )
        * count["selective"]
        / max(len(plan.layers), 1)
    )
    compute = m * (t_f + t_b + t_rc)
    core = sum(g.flops + g.backward_flops for g in work.gemms if g.name in CORE)
    attention_s = gemm_f * core / max(work.flops, 1.0)  # forward + backward, one micro-batch
    t_w = gemm_f * sum(g.flops * g.dw for g in work.gemms if g.name not in CORE) / max(work.flops, 1.0)  # weights
    z = (t_f + t_b - 2 * t_w) / (t_f + t_b) if cfg.parallel.schedule in SPLIT and dims.pp > 1 else 1.0

    timed = timed_traffic(plan, cluster, t_f, t_b, t_rc, attention_s)
    by_group: dict[str, float] = {}
    exposed_by: dict[str, float] = {}
    for tt in timed:
        key = tt.traffic.group
        by_group[key] = by_group.get(key, 0.0) + tt.time_s
        exposed_by[key] = exposed_by.get(key, 0.0) + tt.exposed_s
    exposed_comm = sum(tt.exposed_s for tt in timed)
    in_layer = sum(tt.exposed_s for tt in timed if tt.traffic.dimension in IN_LAYER)
    s = plan.shape
    bubble = z * (s.p - 1) / (s.v * s.m) * (compute + in_layer) if dims.pp > 1 else 0.0

    optimizer, offload = _optimizer(plan, cluster, t_f, t_b)
    total = compute + bubble + exposed_comm + optimizer + offload
    from ..train.flops import flops_per_token

    tokens = cfg.train.global_batch * plan.seq
    fraction = z * (s.p - 1) / (s.v * s.m + z * (s.p - 1)) if dims.pp > 1 else 0.0
    return StepTime(
        total,
        compute,
        m * t_rc,
        m * 3 * elem_f,
        bubble,
        fraction,
        sum(tt.time_s for tt in timed),
        exposed_comm,
        by_group,
        exposed_by,
        optimizer,
        offload,
        tokens,
        flops_per_token(mc, plan.seq, lora) * tokens,
        dims.world_size,
        cluster.peak_flops(precision),
        in_layer,
        plan.rank,
        traffic=timed,
        bubble_scale=z,
    )


def _optimizer(plan: RankPlan, cluster: Cluster, t_f: float, t_b: float) -> tuple[float, float]:
    """``(optimizer step, offload transfers)`` exposed seconds (module docstring)."""
    from ..optim.settings import OptimizerSettings

    cfg, dims = plan.cfg, plan.dims
    zero, offload = cfg.parallel.zero, cfg.memory.offload_optimizer
    replicas = dims.dp * dims.cp
    owned = plan.dense_params / (replicas if zero else 1) + plan.expert_params / ((replicas // dims.ep) if zero else 1)
    if plan.trained_params is not None:  # LoRA: the adapters alone
        owned = plan.trained_params / (replicas if zero else 1)
    settings = OptimizerSettings.from_train(cfg.train)
    p, g = plan.p, plan.g
    k = 4 * len(settings.state_keys) + (4 if p != 4 or offload else 0) + (4 if g != 4 or offload else 0)
    share = cluster.compute_share(dims.world_size)
    if not offload:
        return owned * (2 * k + 2 * p + g) / (cluster.memory_bandwidth_gbps * 1e9 * share), 0.0
    per_node = cluster.ranks_per_node(dims.world_size)
    host_bw = cluster.host_memory_bandwidth_gbps * 1e9 / min(per_node, max(1, dims.world_size))
    host = owned * (2 * k + p + g) / host_bw
    down, up = owned * g / (cluster.host_link_gbps * 1e9), owned * p / (cluster.host_link_gbps * 1e9)
    overlapped = cfg.memory.offload_overlap and zero in (1, 2) and settings.name in ("adamw", "sgd")
    if not overlapped:
        return host, down + up
    late = max(0.0, host + up - t_f)  # the step and the copies up, behind the next forward
    return late * host / (host + up), max(0.0, down - t_b) + late * up / (host + up)


def step_time(
    cfg: Config, dims: ParallelDims, model_cfg: ModelConfig, cluster: Cluster, *, attention: str = "flash"
) -> StepTime:
    """One optimizer step of ``cfg`` laid out as ``dims`` (from ``cfg.validate(world)``), ``model_cfg`` resolved
    (vocabulary and maximum length set: :func:`trickles.models.config.resolve_model`), on ``cluster``: the slowest
    pipeline rank's :class:`StepTime`, with every rank's total in ``stage_s``. ``attention``: the attention kernel
    (:data:`~trickles.planner.compute.ATTENTION`; ``flash`` is trickles', ``materialized`` models systems that write
    the score matrix, such as published Megatron-LM runs of 2021). Raises ConfigError when the layout needs more
    GPUs than the cluster has (CPU ranks may share cores)."""
    world = dims.world_size
    if cluster.device == "cuda" and world > cluster.devices:
        raise ConfigError(
            f"the layout needs {world} devices, the cluster {cluster.name!r} has {cluster.devices} "
            f"({cluster.nodes} x {cluster.devices_per_node}); use Cluster.sized({world}) or fewer ranks"
        )
    cluster.validate()
    if attention not in ATTENTION:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    plans = rank_plans(cfg, dims, model_cfg)
    if cluster.device == "cpu" and dims.pp > 1 and cluster.compute_share(world) < 1:
        worst = _shared_cores(plans, cluster, attention, world)
    else:
        steps = _stages(plans, cluster, attention)
        worst = max(steps, key=lambda s: s.total_s)
        worst.stage_s = [s.total_s for s in steps]
    worst.notes = _notes(worst, dims, cluster)
    return worst


def _stages(plans: list[RankPlan], cluster: Cluster, attention: str, contention: bool = True) -> list[StepTime]:
    """Every pipeline rank's :class:`StepTime`, each rank's bubble the other stages' share of the fill and drain
    (module docstring): ``sum_{s != r} u_s / v``, ``u_s`` one micro-batch of stage ``s`` (its compute and exposed
    in-layer communication over ``m``) -- ``(p - 1) / (v m)`` of its own when the stages are even.

    CPU ranks with a core each (``contention``) compute at the rate calibrated with every core busy; a core running
    while its peers wait is ``kappa = core_contention`` times faster. Stage ``r``'s compute ``c_r`` thus becomes
    ``c_r (1 + (kappa - 1) b_r) / kappa``, ``b_r = mean_{s != r} min(1, c_s / c_r)`` the share of its time the
    others are busy, and the fill and drain it waits for run at the lone rate, ``/ kappa``."""
    import dataclasses

    steps = [rank_step(plan, cluster, attention) for plan in plans]
    if len(steps) < 2:
        return steps
    shape = plans[0].shape
    kappa = cluster.core_contention if contention and cluster.device == "cpu" else 1.0
    kappa = kappa if cluster.compute_share(plans[0].dims.world_size) >= 1 else 1.0
    compute = [st.compute_s for st in steps]
    per_micro = [(st.compute_s + st.in_layer_s) / shape.m for st in steps]
    out = []
    for r, st in enumerate(steps):
        busy = sum(min(1.0, c / max(compute[r], 1e-30)) for i, c in enumerate(compute) if i != r) / (len(steps) - 1)
        own = compute[r] * (1 + (kappa - 1) * busy) / kappa
        bubble = st.bubble_scale * (sum(per_micro) - per_micro[r]) / shape.v / kappa
        total = st.total_s - st.bubble_s - st.compute_s + own + bubble
        f = own / compute[r] if compute[r] > 0 else 1.0
        out.append(
            dataclasses.replace(
                st,
                compute_s=own,
                recompute_s=st.recompute_s * f,
                elementwise_s=st.elementwise_s * f,
                bubble_s=bubble,
                total_s=total,
            )
        )
    return out


def _shared_cores(plans: list[RankPlan], cluster: Cluster, attention: str, world: int) -> StepTime:
    """A pipeline of CPU ranks that outnumber the cores: the scheduler gives a waiting rank's core (the bubble, a
    lighter stage, a message) to a busy one, so no stage runs at a fixed ``compute_share``. The step is the longer
    of the slowest stage's own chain at a full core (:func:`_stages` with a core per rank) and the node's arithmetic
    over its cores: the mean over the stages of each one's step at its share of the cores without its bubble
    (compute, exposed communication with its waits, optimizer) -- the whole node's work over its cores, with no
    bubble, since other ranks' work fills it."""
    import dataclasses

    own = dataclasses.replace(cluster, devices_per_node=cluster.ranks_per_node(world))  # a core per rank
    full = _stages(plans, own, attention, contention=False)  # the cores are all busy: no lone rate
    chain = max(full, key=lambda s: s.total_s)
    shared = [rank_step(plan, cluster, attention) for plan in plans]
    mean = lambda get: sum(get(st) for st in shared) / len(shared)  # noqa: E731
    busy = mean(lambda st: st.total_s - st.bubble_s)
    if chain.total_s >= busy:
        chain.stage_s = [s.total_s for s in full]
        return chain
    groups = {k for st in shared for k in st.exposed_by_group}
    pooled = dataclasses.replace(
        max(shared, key=lambda s: s.total_s),
        total_s=busy,
        bubble_s=0.0,
        compute_s=mean(lambda st: st.compute_s),
        optimizer_s=mean(lambda st: st.optimizer_s),
        offload_s=mean(lambda st: st.offload_s),
        exposed_comm_s=mean(lambda st: st.exposed_comm_s),
        in_layer_s=mean(lambda st: st.in_layer_s),
        recompute_s=mean(lambda st: st.recompute_s),
        elementwise_s=mean(lambda st: st.elementwise_s),
        exposed_by_group={k: mean(lambda st, k=k: st.exposed_by_group.get(k, 0.0)) for k in groups},
    )
    pooled.stage_s = [pooled.total_s] * len(full)
    return pooled


def _notes(st: StepTime, dims: ParallelDims, cluster: Cluster) -> list[str]:
    """Lines for a report: groups whose collectives run across nodes in every layer, and what dominates."""
    notes = []
    per_node = cluster.ranks_per_node(dims.world_size)
    for group in sorted({tt.traffic.group for tt in st.traffic if tt.traffic.dimension in IN_LAYER}):
        if group != "pp" and spans_nodes(dims, group, per_node) and st.exposed_by_group.get(group, 0) > 0:
            nodes = max(len({r // per_node for r in members}) for members in group_members(dims, group))
            notes.append(
                f"{group}={group_size(dims, group)} spans {nodes} nodes: its collectives in every layer run on the "
                f"inter-node link ({st.exposed_by_group[group]:.3g} s exposed a step)"
            )
    if st.bubble_s > 0.1 * st.total_s:
        notes.append(
            f"pipeline bubble {st.bubble_s / st.total_s:.0%} of the step ((p-1)/(v m) = "
            f"{st.bubble_fraction / (1 - st.bubble_fraction):.2f} of compute)"
        )
    return notes
