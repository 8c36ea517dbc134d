"""Each dimension's bytes in one training step, as :class:`Traffic` on a named group -- read from the library.

Every dimension states its bytes once, next to the code that sends them, and the ledger is tested against that
statement; this module only evaluates them for a layout and says which group each travels on and what the
engine overlaps it with (:attr:`Traffic.overlap`, interpreted by :mod:`trickles.planner.cost`):

==================  ===============================================================  ===========================
dimension           formula (library)                                                overlap
==================  ===============================================================  ===========================
tensor 1-D          :func:`trickles.parallel.tensor.region_bytes.region_wire_bytes`  ``none``: on the critical
                    per micro-batch;                                                 path of every layer
                    :func:`~trickles.parallel.tensor.region_bytes.partial_grad_elements`
                    and the norm once a step
tensor grid         :func:`trickles.parallel.tensor.grid_linear.summa_bytes` /       ``none``
                    :func:`~trickles.parallel.tensor.grid_linear.cube_bytes` per
                    linear (:func:`grid_traffic`), split by row / column / depth
                    line
data / ZeRO         :func:`trickles.parallel.reduction.reduction_wire_bytes` on the  ``backward`` (bucket
                    rank's buckets, over the replicas (experts: ``edp``); LoRA: the  reductions), ``forward``
                    adapters' buckets, ZeRO-3 also gathering the frozen parts'       (ZeRO-1/2 parameter
                                                                                     gathers), ``prefetch``
                                                                                     (ZeRO-3 gathers)
pipeline            :func:`trickles.parallel.pipeline.stages.send_bytes`; a tied     ``pipeline`` (fill and
                    embedding's gradient all-reduce over ``pp_ends``                 drain on the critical path)
context             :func:`trickles.parallel.context.layer_bytes` per layer          ring: ``attention`` (the
                                                                                     next block arrives while
                                                                                     this one is used);
                                                                                     all-to-all: ``none``
expert              :func:`trickles.parallel.expert.dispatch_wire_bytes`,            ``none``
                    balanced load
==================  ===============================================================  ===========================

A new dimension adds a function to :data:`TERMS` (taking the :class:`~trickles.planner.rank_plan.RankPlan`) rather
than the time model special-casing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..comm import wire_bytes
from ..parallel.tensor.layout import block_linears
from .compute_lora import adapter_partial_elements
from .rank_plan import RankPlan

OVERLAPS = ("none", "backward", "forward", "prefetch", "attention", "pipeline")


@dataclass(frozen=True)
class Traffic:
    """``calls`` collectives ``op`` on group kind ``group`` (:data:`trickles.planner.placement.GROUPS`) sending
    ``wire_bytes`` in all from this rank in one step; ``overlap``: what the engine runs them under (:data:`OVERLAPS`);
    ``passes``: how many separate windows they are spread over (micro-steps, layers)."""

    dimension: str
    group: str
    op: str
    calls: int
    wire_bytes: float
    overlap: str = "none"
    passes: int = 1


def tensor_1d(r: RankPlan) -> list[Traffic]:
    """1-D tensor (and sequence) parallelism: the regions' collectives each micro-batch, the partial gradients' and
    the norm's all-reduces once a step. LoRA: the partial gradients are the adapters' replicated factors
    (:func:`~trickles.planner.compute_lora.adapter_partial_elements`); on the first stage the frozen embedding's
    output needs no gradient, so the first attention region's entry takes no backward all-reduce (sequence parallel:
    reduce-scatter) and under sequence parallelism the embedding's exit no backward all-gather -- exact when the first
    block adapts q, k or v (else more of its backward is skipped: an upper bound); and under sequence parallelism no
    region (nor the output layer) gathers its input again in backward, since its frozen linears take no weight
    gradient (:class:`~trickles.parallel.tensor.layers.TPContext`; fully recomputed blocks keep their rerun's
    entries)."""
    from ..parallel.tensor.region_bytes import partial_grad_elements, region_wire_bytes

    d = r.dims
    if d.tp == 1 or d.grid.mode != "1d":
        return []
    mc, m = r.model_cfg, r.micro_batches
    moe = sum(1 for i in r.layers if i in set(mc.moe_layers))
    modes = r.recompute
    per = region_wire_bytes(
        r.tokens,
        mc.d_model,
        r.p,
        d.tp,
        r.sp,
        len(r.layers) - moe,
        moe,
        r.first,
        r.last,
        r.cfg.memory.recompute,
        sum(1 for i in r.layers if modes[i] == "full"),
        mc.qk_norm == "full",
    )
    lora = r.cfg.train.lora()
    act = r.tokens * mc.d_model * r.p
    skipped = {}
    if lora is not None and r.first and r.layers and r.layers[0] == 0:  # no gradient into the embedding's output
        skipped = {"reduce_scatter": (1, act), "all_gather": (1, act // d.tp)} if r.sp else {"all_reduce": (1, act)}
    if lora is not None and r.sp:  # frozen linears gather no input again in backward (they take no weight gradient)
        moe_layers = set(mc.moe_layers)
        again = sum(1 if i in moe_layers else 2 for i in r.layers if modes[i] != "full") + int(r.last)
        calls = skipped.get("all_gather", (0, 0))[0] + again
        skipped["all_gather"] = (calls, act // d.tp)
    for op, (calls, size) in skipped.items():
        c0, b0, w0 = per[op]
        per[op] = (c0 - calls, b0 - calls * size, w0 - calls * int(round(wire_bytes(op, size, d.tp))))
    out = [Traffic("tp", "tp", op, calls * m, wire * m) for op, (calls, _, wire) in per.items()]
    partial = partial_grad_elements(mc, d.tp, r.sp, len(r.layers), r.first, r.last, r.moe_elements if r.sp else 0)
    if lora is not None:  # LoRA: only the adapters' replicated factors have gradients
        partial = adapter_partial_elements(mc, lora, r.layers, r.last, d.tp)
    for nbytes in [4] + ([partial * r.g] if partial else []):
        out.append(Traffic("tp", "tp", "all_reduce", 1, wire_bytes("all_reduce", nbytes, d.tp)))
    return out


def grid_traffic(r: RankPlan) -> list[Traffic]:
    """2-D, 2.5-D and 3-D tensor parallelism, per line of the grid (``tp_row``, ``tp_col``, ``tp_dep``; a rank holds
    ``n`` tokens, ``N/q``, ``N/(q d)``, ``N/q^2``; ``AR``, ``AG``, ``RS`` as in :mod:`trickles.comm`):

    * every linear ``h -> h'`` (a block's each gathers its own input, unfused projections ``X`` once each:
      :func:`~trickles.parallel.tensor.layout.block_linears`; the output layer): the layers' own formulas,
      :func:`~trickles.parallel.tensor.grid_linear.summa_bytes` -- the input's gather and its gradient's reduce-scatter
      ``(q-1) p n h/q`` each on the row, the weight's ``(q-1) p h h'/q^2`` each and the bias's ``AR(p h'/q)`` on the
      column, 2.5-D's weight all-reduce on the depth -- and :func:`~trickles.parallel.tensor.grid_linear.cube_bytes`
      (the weight's part on the column, the activations' on the row and depth lines, which swap roles from one linear to
      the next);
    * every norm: its statistics ``AR(4n)`` forward and backward on the hidden line (LayerNorm twice forward,
      ``AR(8n)`` backward), its weight's (and bias's) gradient ``AR(p d/q)`` over each token line;
    * the embedding table: 2-D/2.5-D ``AG(p V d/q^2)`` forward, ``RS(p V d/q)`` backward on the column (2.5-D:
      ``AR(p V d/q^2)`` on the depth; tied: the block swapped with rank ``(j, i)``, ``p V d/q^2`` each way); 3-D
      ``AG(p V d/q^3)`` / ``RS(p V d/q^2)`` on the column and ``RS(p N d/q^2)`` / ``AG(p N d/q^3)`` on the row;
      gpt2's positions ``AR(p T_max d/q)`` over each token line; the loss ``3 AR(4n)`` on the row and two ``AR(4)``
      over each of the logits' token lines; the gradient norm ``AR(4)`` over ``tp``. Full recomputation runs each
      block's forward again.

    (The same sums as ``trickles/parallel/tensor/costs.py``'s, which another branch adds, kept here split by line
    until it lands; then read them from there.)"""
    from ..parallel.tensor.grid_linear import cube_bytes, summa_bytes

    d, mc = r.dims, r.model_cfg
    g = d.grid
    if d.tp == 1 or g.mode == "1d":
        return []
    q, dep, p, n_all, three = g.q, g.depth, r.p, r.tokens, g.mode == "3d"
    n = n_all // (q * q if three else q * dep)
    dm, V, ln = mc.d_model, mc.vocab_size, mc.flavor == "gpt2"
    hidden = "tp_dep" if three else "tp_row"
    token_lines = {"2d": ["tp_col"], "2.5d": ["tp_col", "tp_dep"], "3d": ["tp_col", "tp_row"]}[g.mode]
    size = {"tp_row": q, "tp_col": q, "tp_dep": dep if not three else q, "tp": d.tp}
    fwd: dict[tuple[str, str], list[float]] = {}
    bwd: dict[tuple[str, str], list[float]] = {}

    def add(into, line: str, op: str, nbytes: float, times: int = 1) -> None:
        if size[line] > 1 and nbytes > 0:
            calls, wire = into.setdefault((line, op), [0, 0.0])
            into[(line, op)] = [calls + times, wire + times * round(wire_bytes(op, nbytes, size[line]))]

    roles = [0]  # 3-D: linears so far (the row and depth lines swap the a and b roles from one to the next)

    def linear(h: int, h2: int, bias: bool) -> None:
        if three:
            x, w = cube_bytes(q, n_all, h, 0, False, p)["forward"], cube_bytes(q, 0, h, h2, False, p)["forward"]
            y = cube_bytes(q, n_all, 0, h2, False, p)["forward"]
            a, b = ("tp_row", "tp_dep") if roles[0] % 2 == 0 else ("tp_dep", "tp_row")
            roles[0] += 1
            # forward: X gathered on a, the partial outputs reduce-scattered on b; backward: dY gathered on b, dX
            # reduce-scattered on a (the wire bytes x and y given as a gather's shard, a reduce-scatter's input)
            add(fwd, a, "all_gather", x / (q - 1)), add(fwd, b, "reduce_scatter", y * q / (q - 1))
            add(bwd, b, "all_gather", y / (q - 1)), add(bwd, a, "reduce_scatter", x * q / (q - 1))
            add(fwd, "tp_col", "all_gather", w / (q - 1)), add(bwd, "tp_col", "reduce_scatter", w * q / (q - 1))
            if bias:
                add(bwd, "tp_col", "all_reduce", p * h2 // q), add(bwd, "tp_row", "all_reduce", p * h2 / q / 2)
                add(bwd, "tp_dep", "all_reduce", p * h2 / q / 2)
            return
        rows = n_all // (q * dep)
        acts = summa_bytes(q, 1, rows, h, 0, False, p)["forward"] / (q - 1)  # the input block each rank adds
        weights = summa_bytes(q, 1, 0, h, h2, False, p)["forward"] / (q - 1)
        # forward gathers the input and weight blocks; backward reduce-scatters their gradients (as many bytes)
        add(fwd, "tp_row", "all_gather", acts), add(bwd, "tp_row", "reduce_scatter", acts * q)
        add(fwd, "tp_col", "all_gather", weights), add(bwd, "tp_col", "reduce_scatter", weights * q)
        if bias:
            add(bwd, "tp_col", "all_reduce", p * (h2 // q))
        add(bwd, "tp_dep", "all_reduce", p * (h * h2 // (q * q) + (h2 // q if bias else 0)))

    def norm() -> None:
        add(fwd, hidden, "all_reduce", 4 * n, 2 if ln else 1), add(bwd, hidden, "all_reduce", (8 if ln else 4) * n)
        for line in token_lines:
            add(bwd, line, "all_reduce", p * (dm // q), 2 if ln else 1)

    for _ in r.layers:
        norm(), norm()
        for _, h, h2, bias in block_linears(mc):
            linear(h, h2, bias)
    if r.cfg.memory.recompute == "full":
        bwd_blocks = {k: list(v) for k, v in fwd.items()}  # each block's forward, again in backward
        for k, (calls, wire) in bwd_blocks.items():
            c0, w0 = bwd.get(k, [0, 0.0])
            bwd[k] = [c0 + calls, w0 + wire]
    if r.first:
        if three:
            add(fwd, "tp_col", "all_gather", p * V * dm / q**3), add(bwd, "tp_col", "reduce_scatter", p * V * dm / q**2)
            (
                add(fwd, "tp_row", "reduce_scatter", p * n_all * dm / q**2),
                add(bwd, "tp_row", "all_gather", p * n_all * dm / q**3),
            )
        else:
            add(fwd, "tp_col", "all_gather", p * V * dm / q**2), add(bwd, "tp_col", "reduce_scatter", p * V * dm / q)
            add(bwd, "tp_dep", "all_reduce", p * V * dm / q**2)
            if mc.tied:
                add(fwd, "tp", "send", p * V * dm / q**2), add(bwd, "tp", "send", p * V * dm / q**2)
        if ln:
            for line in token_lines:
                add(bwd, line, "all_reduce", p * mc.max_seq_len * dm / q)
    if r.last:
        norm()
        linear(dm, V, False)
        add(fwd, "tp_row", "all_reduce", 4 * n, 3)
        for line in ["tp_col", "tp_dep"] if three else token_lines:
            add(fwd, line, "all_reduce", 4, 2)
    m = r.micro_batches
    totals: dict[tuple[str, str], list[float]] = {}
    for part in (fwd, bwd):
        for k, (calls, wire) in part.items():
            c0, w0 = totals.get(k, [0, 0.0])
            totals[k] = [c0 + m * calls, w0 + m * wire]
    out = [Traffic("tp", line, op, int(calls), wire) for (line, op), (calls, wire) in sorted(totals.items())]
    out.append(Traffic("tp", "tp", "all_reduce", 1, wire_bytes("all_reduce", 4, d.tp)))
    return out


def data_parallel(r: RankPlan) -> list[Traffic]:
    """Gradient averaging (and ZeRO's sharding) over the replicas (``dp x cp``; the experts over ``edp``), the
    trainer's mean-loss all-reduce, and across pipeline stages the gradient norm and a tied embedding's gradient."""
    from ..parallel.reduction import reduction_wire_bytes

    d, cfg = r.dims, r.cfg
    stage, m = cfg.parallel.zero, r.micro_batches
    replicas = "dp_cp" if d.cp > 1 else "dp"
    out: list[Traffic] = []
    groups = [(replicas, d.dp * d.cp, r.buckets, r.frozen_buckets)]
    if d.ep > 1:
        groups.append(("edp", d.dp * d.cp // d.ep, r.expert_buckets, r.frozen_expert_buckets))
    for group, n, buckets, frozen in groups:
        if n > 1 and frozen:  # LoRA under ZeRO-3: the frozen parts gathered for forward and backward, not reduced
            calls, wire = reduction_wire_bytes(frozen, n, 3, m, r.g, r.p)["all_gather"]
            out.append(
                Traffic("dp", group, "all_gather", calls, wire, "prefetch" if cfg.parallel.prefetch else "none", 2 * m)
            )
        if n <= 1 or not buckets:
            continue
        pipelined = d.pp > 1
        steps = m if stage == 3 or (stage == 2 and not pipelined) else 1
        for op, (calls, wire) in reduction_wire_bytes(buckets, n, stage, m, r.g, r.p, pipelined).items():
            if op == "all_reduce" and stage > 0:
                out.append(Traffic("dp", group, op, calls, wire))
            elif op == "all_gather" and stage == 3:  # forward and backward gathers, each prefetched behind a block
                out.append(
                    Traffic("dp", group, op, calls, wire, "prefetch" if cfg.parallel.prefetch else "none", 2 * m)
                )
            elif op == "all_gather":  # ZeRO-1/2: the new parameters, in the background until the next forward
                out.append(Traffic("dp", group, op, calls, wire, "forward", 1))
            else:
                out.append(Traffic("dp", group, op, calls, wire, "backward", steps))
    if d.dp * d.cp > 1:
        out.append(Traffic("dp", replicas, "all_reduce", 1, wire_bytes("all_reduce", 4, d.dp * d.cp)))
    if d.pp > 1:
        # the gradient norm's sum over the stages, and the last stage's loss shared with the others
        out.append(Traffic("pp", "pp", "all_reduce", 2, 2 * wire_bytes("all_reduce", 4, d.pp)))
        if r.model_cfg.tied and r.first != r.last:  # (ZB-V holds both ends on one rank: one copy, nothing to sum)
            tied = r.model_cfg.vocab_size * r.model_cfg.d_model // d.tp * r.g
            out.append(Traffic("pp", "pp_ends", "all_reduce", 1, wire_bytes("all_reduce", tied, 2)))
    return out


def pipeline(r: RankPlan) -> list[Traffic]:
    """Activations to the next stage and gradients to the previous one, every micro-batch."""
    from ..parallel.pipeline.stages import send_bytes

    if r.dims.pp == 1:
        return []
    forward, backward = send_bytes(r.shape, r.rank, r.message_bytes)
    calls = (forward + backward) // max(1, r.message_bytes)
    return [Traffic("pp", "pp", "send", calls, forward + backward, "pipeline", max(1, calls))]


def context_parallel(r: RankPlan) -> list[Traffic]:
    """Ring or all-to-all attention in every layer the rank holds, forward and backward (full recomputation runs
    the forward's messages again)."""
    from ..parallel.context import layer_bytes

    d, mc = r.dims, r.model_cfg
    if d.cp == 1:
        return []
    tp = d.tp
    heads = mc.n_heads // tp
    kv = mc.kv_heads // tp if mc.kv_heads % tp == 0 else heads
    mode = r.cfg.parallel.cp_mode
    dv = mc.v_head_dim if mc.attention == "mla" else None  # (latent attention: every head has its own keys)
    if mc.attention == "mla":
        kv = heads
    fwd, bwd = layer_bytes(mode, d.cp, r.micro, heads, kv, r.tokens // r.micro, mc.head_dim, r.p, dv)
    modes = r.recompute
    passes = len(r.layers) * r.micro_batches
    reruns = sum(1 for i in r.layers if modes[i] == "full") * r.micro_batches  # layers whose forward runs again
    out = []
    for op in fwd:
        calls = passes * (fwd[op][0] + bwd[op][0]) + reruns * fwd[op][0]
        held = passes * (fwd[op][1] + bwd[op][1]) + reruns * fwd[op][1]
        wire = held if op == "send" else wire_bytes(op, held, d.cp)
        out.append(Traffic("cp", "cp", op, calls, wire, "attention" if mode == "ring" else "none", passes))
    return out


def expert_parallel(r: RankPlan) -> list[Traffic]:
    """The dispatch and return all-to-alls of every MoE block pass, under a balanced load with every expert taking
    all it may (capacity's upper bound: what a step sends depends on the routing); and the step's routing
    statistics, all-reduced over every rank."""
    from ..memory.moe_activations import moe_assignments
    from ..parallel.expert import dispatch_wire_bytes

    d, mc = r.dims, r.model_cfg
    out = []
    if mc.moe_layers and d.world_size > 1:  # the trainer's step statistics: 5 + layers x experts fp64 over all ranks
        stats = 8 * (5 + len(mc.moe_layers) * mc.moe_experts)
        out.append(Traffic("moe", "world", "all_reduce", 1, wire_bytes("all_reduce", stats, d.world_size)))
    blocks = sum(1 for i in r.layers if i in set(mc.moe_layers)) * r.micro_batches
    if d.ep == 1 or not blocks:
        return out
    routed = r.tokens // d.tp if r.sp and d.tp > 1 else r.tokens
    off = moe_assignments(mc, r.micro, routed // r.micro, r.seq) * (d.ep - 1) // d.ep * blocks
    calls, wire = dispatch_wire_bytes(off, off, mc.d_model, r.p, mc.moe_experts, d.ep, blocks)
    return out + [Traffic("ep", "ep", "all_to_all", calls, wire)]


#: The per-dimension terms, in the order the report lists them.
TERMS: list[Callable[[RankPlan], list[Traffic]]] = [
    tensor_1d,
    grid_traffic,
    context_parallel,
    expert_parallel,
    pipeline,
    data_parallel,
]
