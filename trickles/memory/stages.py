"""Pipeline stages in the memory report: what each pipeline rank holds, and its micro-batches in flight.

Notation of :mod:`trickles.parallel.pipeline.schedules`: ``p`` pipeline ranks, ``v`` chunks per rank, ``m``
micro-batches; rank ``r``'s chunk ``c`` is virtual stage ``c p + r`` and holds the layers
:func:`~trickles.parallel.pipeline.stages.partition_layers` gives it (``parallel.pipeline_layers`` respected).

**Model states** of rank ``r``: the ZeRO formulas on its own parameters (its chunks' layers, the embedding and
gpt2's positions on rank 0, the final norm and output projection on rank ``p - 1``, with a tied embedding the
last rank's copy), :func:`~trickles.memory.meta.stage_parameters`.

**Activations.** One micro-batch through chunk ``c`` keeps ``A_c`` = its layers' bytes
(:func:`~trickles.memory.activations.activation_bytes`), plus the embedding's (token ids, gpt2's position ids,
the embedding dropout's mask) on virtual stage 0 and the head's (final norm, loss) on the last virtual stage
(:func:`chunk_bytes`). A chunk's activations live from its forward to its backward, so the rank holds at once
``max_t sum_{(c, i) alive at t} A_c``, read off the rank's own compute order
(:func:`~trickles.parallel.pipeline.schedules.compute_order`) by :func:`peak_in_flight`. With equal chunks that is ``A``
times the most chunk-micro-batches alive (:func:`in_flight`), whose closed forms are

* GPipe: ``m`` (every forward before the first backward);
* 1F1B: ``min(m, p - r)`` (``p - r - 1`` warm-up forwards and the one before the first backward);
* interleaved: ``min(2 (p - r - 1) + (v - 1) p + 1, v m)`` chunks (the warm-up forwards, then one forward ahead
  of each backward) -- on rank 0 ``(v + 1) p - 1``, i.e. ``p - 1 + (v - 1) p + 1`` micro-batches' worth of
  chunks, each ``1 / v`` of the rank's layers: about ``(1 + (p - 1) / (v p))`` x the ``p`` micro-batches of 1F1B.

(:func:`in_flight_closed_form`; the tests hold it equal to the walk.)

**Transient** (beyond the saved activations, :func:`buffers_peak`): the runner
(:class:`~trickles.parallel.pipeline.runner.PipelineRunner`) keeps a chunk's output until its send is seen through
(``M`` = one message, ``p_b B T d`` bytes in the compute type; :func:`message_bytes`) -- its backward starts from the
output's place in the graph, not the tensor; on gloo, which reports a send done only once waited for, until the rank
next waits for a message, else until its next computation -- or, handed to a chunk of the same rank (ZB-V's turn), as
that chunk's input; and the input it received where
no operation saves the tensor itself (llama in low precision: the norm keeps an fp32 copy); every receive buffer
exists from when it is posted -- on gloo all of a step's receives at the rank's first wait, else as
:func:`~trickles.parallel.pipeline.schedules.with_messages` places them -- the activations' until their forward saves
them, the gradients' until their backward; an input gradient until its send (under a split backward with the
input saved, until ``W``: it sits on the input, which the graph keeps); the step's token ids and labels; and on
the last rank the loss's backward (:func:`~trickles.memory.activations.loss_transient_bytes`; unfused, in a whole
backward, the output projection's, :func:`~trickles.memory.transients.head_backward_bytes`, when larger), or in any
backward a layer's own (:func:`~trickles.memory.transients.block_backward_bytes`: the top block's, which reads the
received gradient itself), and under recomputation what it brings back of one layer (the layer's activations
without recomputation, less what it keeps); on the last rank the final norm's input gradient runs beside it. A
split ``B`` ends in its first norm's backward with every gradient for ``W`` recorded (:func:`buffers_peak`). The walk
over the rank's action list (:func:`~trickles.parallel.pipeline.schedules.build`) gives the most of all these alive
at once, minus the saved activations at their peak; on a CPU it meets the measured peak within 0.1% where these are
all the transients (the tests' stages).
"""

from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache

from ..parallel.pipeline.actions import Action, Shape, _messages, _producer, uniform_times
from ..parallel.pipeline.schedules import SPLIT, compute_order, handoff
from ..parallel.tensor.layout import block_norms


def chunk_bytes(act: dict, embedding: int, parts: list[list[int]], shape: Shape, rank: int) -> list[tuple[int, int]]:
    """``[(layers, head)]`` per chunk of ``rank``: one micro-batch's saved bytes in its layers, and in the embedding
    (first virtual stage) or head (last). ``act``: the whole model's :func:`activation_bytes`; ``embedding``: the
    part of ``act["head"]`` the embedding keeps. Tables kept once per forward go with each chunk's first layer."""
    out = []
    for c in range(shape.v):
        s = shape.stage(rank, c)
        layers = sum(act["per_layer"][i] for i in parts[s]) + (act["tables"] if s > 0 else 0)
        head = (embedding if s == 0 else 0) + (act["head"] - embedding if s == shape.stages - 1 else 0)
        out.append((layers, head))
    return out


def peak_in_flight(order: list[Action], weights: list[tuple[int, int]] | dict) -> tuple[int, int, int]:
    """``(layers, head, chunks)`` alive at the first moment the sum ``layers + head`` of the chunk-micro-batches whose
    forward ran and backward did not is largest, walking ``order`` (``weights[c]``: chunk ``c``'s ``(layers, head)``;
    or a dict by ``(chunk, micro-batch)``, measured)."""
    alive = [0, 0, 0]
    best = (0, 0, 0)
    release = "W" if any(a.kind == "W" for a in order) else "B"  # zero-bubble: a chunk's activations stay until its W
    for a in order:
        if a.kind not in ("F", release):
            continue
        sign = 1 if a.kind == "F" else -1
        lay, head = weights[(a.chunk, a.micro)] if isinstance(weights, dict) else weights[a.chunk]
        alive = [alive[0] + sign * lay, alive[1] + sign * head, alive[2] + sign]
        if alive[0] + alive[1] > best[0] + best[1]:
            best = tuple(alive)
    return best


def in_flight(schedule: str, shape: Shape, rank: int) -> int:
    """The most chunk-micro-batches alive on ``rank`` (forward run, backward not), from the library's compute order."""
    return peak_in_flight(compute_order(schedule, shape, rank), [(1, 0)] * shape.v)[2]


def in_flight_closed_form(schedule: str, shape: Shape, rank: int) -> int:
    """The module docstring's closed forms of :func:`in_flight`."""
    p, v, m = shape.p, shape.v, shape.m
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, v * m)


def message_bytes(micro: int, seq: int, d_model: int, p: int, tp: int, split: bool, cp: int = 1) -> int:
    """One pipeline message (an activation or its gradient): ``[micro, seq / cp, d]`` in the compute type, ``1 / tp``
    of it when the tensor-parallel layout splits activations between the layers (sequence parallelism, a grid)."""
    return p * micro * (seq // cp) * d_model // (tp if split else 1)


def input_saved(flavor: str, p: int, device_type: str, recompute: str) -> bool:
    """Whether the first operation of a chunk saves the received input tensor itself (then it is counted with the
    activations): full recomputation's checkpoint does; RMSNorm in fp32 does (in low precision it keeps an fp32
    copy); LayerNorm does on a CPU and in fp32 (CUDA autocast keeps an fp32 copy)."""
    if recompute == "full" or p == 4:
        return True
    return flavor == "gpt2" and device_type != "cuda"


def buffers_peak(
    schedule: str,
    shape: Shape,
    rank: int,
    weights: list[tuple[int, int]],
    msg: int,
    saves_input: bool | list[bool],
    loss_transient: int,
    early_receives: bool,
    backward_transient: int | list[int] = 0,
    gathered: list[tuple[int, int]] | None = None,
    recorded: list[int] | None = None,
    split_end: int | tuple[int, int] = 0,
    loss_saved: int = 0,
) -> int:
    """The most bytes alive at once on ``rank`` over a step -- saved activations, the stage outputs and inputs the
    runner holds, receive buffers, input gradients until sent, and during a backward ``backward_transient``, a
    layer's own -- on the last virtual stage the larger of the loss's and that less the head's activations, which
    the loss's backward frees before the layers' begins (module docstring). ``gathered``: per chunk, what ZeRO-3
    holds beyond the shards during its forward and during its backward (:func:`zero3_gathered`). ``recorded``: per
    chunk, what a zero-bubble ``B`` records for its ``W`` (:func:`recorded_bytes`), held from the one to the other --
    except on the first virtual stage, which reads no activation: there ``B`` does nothing and ``W`` runs the whole
    backward (its transient then), the received gradient held until it. A ``B`` elsewhere peaks as it ends, in the
    chunk's first norm's backward: every gradient for ``W`` recorded by then (the received one among them: the last
    block's output projection reads it as it came), the input gradient it makes, and ``split_end``, that backward's
    own (:func:`~trickles.memory.transients.split_end_bytes`; a pair: elsewhere and on the last stage);
    ``loss_saved``: what the loss's own nodes save, freed as the last stage's ``B`` ends. ``saves_input`` and
    ``backward_transient`` may be given per chunk (layers recomputed in different ways:
    ``memory.recompute_num_layers``)."""
    per_chunk = [
        (
            saves_input[c] if isinstance(saves_input, list) else saves_input,
            backward_transient[c] if isinstance(backward_transient, list) else backward_transient,
        )
        for c in range(shape.v)
    ]
    actions = action_lists(schedule, shape, early_receives)[rank]
    last = shape.stages - 1
    split = schedule in SPLIT  # zero-bubble: the activations and the received input stay until W
    alive = peak = 0
    pending_grads = 0  # input gradients produced, not yet known to be sent
    outputs = 0  # stage outputs sent, until the runner has seen their sends through
    for a in actions:
        s = shape.stage(rank, a.chunk)
        saves_input, backward_transient = per_chunk[a.chunk]
        if a.is_compute and (not early_receives or _messages(a, shape, rank)[0] is not None):
            alive -= outputs  # gloo: waited for before the next wait for a message; else done by then
            outputs = 0
        if a.kind == "RECV_F" or a.kind == "RECV_B":
            alive += msg
        elif a.kind == "F":
            alive -= pending_grads
            pending_grads = 0
            lay, head = weights[a.chunk]
            alive += lay + head + (msg if s < last else 0) - (msg if s > 0 and saves_input else 0)
            peak = max(peak, alive + (gathered[a.chunk][0] if gathered else 0))
            if s < last and handoff(a, shape, rank) is None:  # sent: gone once the send is seen through
                outputs += msg
        elif a.kind == "B":
            alive -= pending_grads
            pending_grads = 0
            if split and s == 0:  # the first stage reads no activation: its B does nothing (the received gradient
                continue  # waits), its W is the whole backward (trickles.parallel.pipeline.split)
            lay, head = weights[a.chunk]
            # the loss's backward first; the layers' after it has freed the head's activations, with the final norm's
            # input gradient running down the residual stream beside theirs (elsewhere the top block's backward, the
            # heaviest, reads the received gradient itself there)
            flowing = msg if s == last and s > 0 else 0
            during = (
                max(loss_transient, backward_transient - head + flowing) if s == last else backward_transient + flowing
            )
            if gathered:  # ZeRO-3: the loss's backward with the root gathered, a block's with its units, its reduction
                _, loss_root, begins, reduce, released = gathered[a.chunk]
                freed = head if s == last else 0
                during = max(
                    loss_transient + loss_root if s == last else 0,
                    backward_transient - freed + begins + flowing,
                    reduce - released - freed + flowing,
                )
            peak = max(peak, alive + during)
            if split and recorded:  # B's end: what it recorded (the received gradient among it, already alive but
                # on the last stage), the input gradient it makes, its first norm's backward
                end = split_end if isinstance(split_end, int) else split_end[s == last]
                peak = max(peak, alive + recorded[a.chunk] + (msg if s == last else 0) + end)
            kept = lay + head + (msg if s > 0 and not saves_input else 0)  # (until W, when split)
            alive -= 0 if split else kept
            alive -= msg if s < last else 0  # the received gradient, consumed
            if s > 0:  # the input gradient: sent, or handed to this rank's chunk below
                alive += msg  # (split, with the input saved: on the input, which its graph keeps until W)
                pending_grads = 0 if handoff(a, shape, rank) is not None or (split and saves_input) else msg
            alive += recorded[a.chunk] if split and recorded else 0
            alive -= loss_saved if split and s == last else 0  # nothing holds the loss's nodes above the head's W
            peak = max(peak, alive)
        elif a.kind == "W":
            lay, head = weights[a.chunk]
            if s == 0:
                peak = max(peak, alive + backward_transient)
                alive -= lay + head + (msg if s < last else 0)
                continue
            alive -= lay + head - (loss_saved if s == last else 0) + (msg if s > 0 and not saves_input else 0)
            alive -= recorded[a.chunk] if recorded else 0
            if s > 0 and saves_input and handoff(Action("B", a.chunk, a.micro), shape, rank) is None:
                outputs += msg  # the input gradient, off the input now: gone once its send is seen through
    return peak


def recorded_bytes(
    mc, layers: int, tokens: int, p: int, tp: int = 1, sp: bool = False, head: bool = False, fused_loss: bool = False
) -> int:
    """Bytes a zero-bubble ``B`` records for ``W`` in one micro-batch through a chunk of ``layers`` blocks
    (:mod:`~trickles.parallel.pipeline.split`): the gradient arriving at every node with an edge toward a weight, kept
    until ``W`` multiplies it by the saved input -- per block the outputs of the query, key and value projections and of
    the gate and up (llama) or first MLP (gpt2) projection, sharded over ``tp`` (column-parallel), of the attention's
    and the MLP's output projections (row-parallel: whole before their reduction), of the norms (two, four with
    ``model.norm_placement=sandwich``; sharded over ``tp`` under sequence parallelism) and of the q/k norms
    (``model.qk_norm``): ``tokens (q + 2 kv + 2f [gpt2: f] [+ q + kv]) / tp + 2 tokens d + n tokens' d``
    elements of ``p`` bytes; with ``head`` (the last stage) the final norm's ``tokens' d`` and the output projection's
    ``tokens V / tp`` unless the loss is fused (its own function computes both gradients from the loss's).
    """
    d, f = mc.d_model, mc.ffn_dim
    q, kv = mc.n_heads * mc.head_dim, mc.kv_heads * mc.head_dim
    column = q + 2 * kv + (2 * f if mc.flavor == "llama" else f)
    norm_tokens = tokens // tp if sp and tp > 1 else tokens
    column += q + kv if mc.qk_norm != "none" else 0
    per_block = tokens * column // tp + 2 * tokens * d + block_norms(mc) * norm_tokens * d
    out = p * layers * per_block
    if head:
        out += p * norm_tokens * d + (0 if fused_loss else p * tokens * mc.vocab_size // tp)
    return out


def zero3_gathered(
    named: list,
    parts: list[list[int]],
    shape: Shape,
    rank: int,
    per_layer: list[int],
    p: int,
    g: int,
    dp: int,
    clones: bool,
) -> list[tuple[int, int, int, int, int]]:
    """What ZeRO-3 holds beyond its shards while each chunk of ``rank`` runs -- ``named``: the rank's parameters,
    ``per_layer``: each layer's saved activation bytes -- from each chunk's ``(root, last, blocks, block, saved)``: the
    elements of the root it reads (the embedding or the head, or 0), whether it ends with the head, its block count,
    its largest block's elements, and what its top block saves for backward. Returns ``[(forward, loss, begins, reduce,
    released)]``:

    * ``forward``: the root and the running block gathered, the next block prefetched (``p`` bytes an element);
    * ``loss`` (the last stage): the root gathered while the loss's backward runs;
    * ``begins``: through a block's backward, the root, the block and the one before it (prefetched) gathered, the
      block's weights' gradients as they come (``g`` bytes an element), and on the last stage the head's weight
      gradient, computed first and reduced with the root's at the chunk's end;
    * ``reduce``: as the top block's backward ends -- its saved tensors (``released``) freed by then -- the larger of
      its weights' gradients being joined into one unit-sized tensor, and its reduce-scatter (its gathered weights
      freed first; the unit-sized gradient, the ``1 / dp`` shard it is reduced into and, ``clones``, gloo's copy of
      it: gloo reduce-scatters through an all-reduce of a copy).

    This is an estimate, not a count: on CPU ranks the measured peak of the tests' stages lies within 7% of it (gloo
    also keeps receive copies of gathers in flight, which it leaves out).
    """
    sizes: dict[int, int] = {}  # each block's elements
    for n, prm in named:
        if n.startswith("layers."):
            i = int(n.split(".")[1])
            sizes[i] = sizes.get(i, 0) + prm.numel()
    root_all = sum(prm.numel() for n, prm in named if not n.startswith("layers."))
    out = []
    for c in range(shape.v):
        s = shape.stage(rank, c)
        last, layers = s == shape.stages - 1, parts[s]
        root = root_all if s in (0, shape.stages - 1) else 0
        block, saved = max(sizes[i] for i in layers), per_layer[layers[-1]]
        gathered = p * (root + min(2, len(layers)) * block)
        begins = gathered + (g * root if last else 0) + g * block
        reduce = max(begins + g * block, begins - p * block + g * block * (1 + clones) + g * block // dp)
        out.append((gathered, p * root if last else 0, begins, reduce, saved))
    return out


@lru_cache(maxsize=32)
def action_lists(schedule: str, shape: Shape, early_receives: bool) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions with their messages, as :func:`~trickles.parallel.pipeline.schedules.build` places them
    (each send after its compute; each receive after the last compute its rank starts before the send, on gloo no later
    than the rank's first wait), found by bisection in each rank's start times: ``build``'s count of earlier starts is
    quadratic in the micro-batches, and a layout search asks for thousands (the tests hold the two equal)."""
    orders = [compute_order(schedule, shape, r) for r in range(shape.p)]
    times = uniform_times(orders, shape)
    out = []
    for r, order in enumerate(orders):
        starts = [times[(r, a)][0] for a in order]  # strictly increasing: one compute after another
        slots: list[list[tuple[int, int, Action]]] = [[] for _ in range(len(order) + 1)]
        first_read = next((k for k, a in enumerate(order) if _messages(a, shape, r)[0] is not None), 0)
        for k, a in enumerate(order):
            recv, send = _messages(a, shape, r)
            if send:
                slots[k + 1].append((0, k, send))
            if recv:
                slot = bisect_left(starts, times[_producer(a, shape, r)][1])
                slots[min(slot, first_read) if early_receives else slot].append((1, k, recv))
        acts: list[Action] = []
        for k, slot in enumerate(slots):
            if k:
                acts.append(order[k - 1])
            acts += [m for *_, m in sorted(slot, key=lambda x: x[:2])]
        out.append(tuple(acts))
    return tuple(out)
