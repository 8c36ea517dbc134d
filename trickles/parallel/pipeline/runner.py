"""Running a pipeline schedule: one rank's action list executed against its stage.

:class:`PipelineRunner` walks the list :func:`~trickles.parallel.pipeline.schedules.build` made for this rank:

* ``F c.i``: the input is micro-batch ``i``'s tokens (virtual stage 0) or the activation received
  for it, made a leaf that requires grad; chunk ``c`` runs forward under the precision policy; the
  last stage computes the loss and keeps ``loss * scale / m`` as what its backward starts from.
  The output (detached) waits in the outbox for its send; the pair (input, output) is kept until
  the backward -- the *live* micro-batches the schedule bounds (``m`` for GPipe, at most ``pp``
  for 1F1B), counted in :attr:`PipelineRunner.peak_alive`.
* ``B c.i``: ``torch.autograd.backward(output, received gradient)`` (the loss alone on the last
  stage) inside the engine's ``micro_step``; it is the *last* micro-step of chunk ``c`` when no
  later backward of the step touches that chunk's parameters, which lets the data-parallel
  engine start reducing them while the rest of the schedule runs. The input's gradient goes to
  the outbox. In the zero-bubble schedules ``B`` computes the input's gradient only
  (:func:`~trickles.parallel.pipeline.split.backward_input`), and ``W c.i`` the weights' later, inside the
  ``micro_step`` (:func:`~trickles.parallel.pipeline.split.backward_weight`); the pair is kept until ``W``.
* ZB-V's turn (the next stage on the same rank): the output, or the input's gradient, is handed over
  without a message.
* a run of messages: posted together without waiting, one ``batch_isend_irecv`` per group --
  activations over ``pp``, gradients over ``pp_grad``. The lists post a receive as soon as its
  send is due (see :mod:`~trickles.parallel.pipeline.schedules`; on gloo, all of them where the rank first
  waits); it is waited for (alone, where the backend allows) just before the compute that reads
  it. Sends are released as they complete and all waited for at the end.

Received shapes follow from the micro-batch: ``[b, T, d]``, or ``[b, T / tp, d]`` while sequence
parallelism is on (each tensor-parallel rank passes its own shard to its peer in the next stage).
The step's loss is the last stage's mean over micro-batches, summed over the pipeline group so
that every stage returns it (``async_loss``: in the background, while the step goes on).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch.autograd.graph import get_gradient_edge

from ...comm import GroupComm
from ..engine import Engine
from .schedules import SPLIT, Action, Shape, batches, build, handoff, peer
from .split import Deferred, backward_input, backward_weight
from .stages import StageChunk
from .timeline import Timeline

Batch = tuple  # (inputs, targets), (inputs, targets, label ids) or (inputs, targets, label ids or None, document ids)


class PipelineRunner:
    """Executes training, evaluation and decoding steps of one pipeline rank."""

    def __init__(
        self,
        engine: Engine,
        chunks: list[StageChunk],
        acts: GroupComm,
        grads: GroupComm,
        schedule: str,
        micro_batches: int,
        d_model: int,
        act_dtype: torch.dtype,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        tp_ctx=None,
        cp_ctx=None,
    ):
        self.engine, self.chunks = engine, chunks
        self.acts, self.grads = acts, grads
        self.rank = acts.rank
        self.schedule = schedule
        self.shape = Shape.of(schedule, acts.size, len(chunks), micro_batches)
        self.split = schedule in SPLIT
        self.d_model, self.act_dtype, self.device = d_model, act_dtype, device
        self.autocast, self.tp_ctx, self.cp_ctx = autocast, tp_ctx, cp_ctx
        # gloo runs every send and receive on its own: a receive may be posted long before it is read
        self.early_receives = acts.backend == "gloo" and grads.backend == "gloo"
        self.actions = build(schedule, self.shape, early_receives=self.early_receives)[self.rank]
        self.final_backward = {}  # chunk -> its micro-batch whose backward (W where split) comes last
        for a in self.actions:
            if a.kind == ("W" if self.split else "B"):
                self.final_backward[a.chunk] = a.micro
        self.trace_enabled = False
        self.last_trace: list[tuple[Action, float, float]] = []
        self.peak_alive = 0
        self._saved: dict[
            tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]
        ] = {}  # (chunk, micro) -> (input, output)
        self._inbox: dict[tuple[str, int, int], tuple[torch.Tensor, object]] = {}  # posted receives
        self._outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # produced, not yet sent
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}  # handed to a chunk of this rank
        self._weights: dict[tuple[int, int], Deferred] = {}  # (chunk, micro) -> what its W needs
        self._sending: list[tuple[object, torch.Tensor]] = []  # sends in flight, with their tensors
        self._decoding = False

    # ---- public steps ----------------------------------------------------------------------
    def forward_backward(self, micro: list[Batch], loss_scale: float = 1.0, async_loss: bool = False):
        """Forward and backward of every micro-batch by the schedule; the mean loss (every stage).

        ``async_loss=True`` returns a :class:`~trickles.comm.Handle` instead, whose ``wait()`` gives
        the loss: its sum over the pipeline group then runs while the caller reduces, clips and
        steps, rather than adding one more synchronization of the stages to the step.
        """
        if len(micro) != self.shape.m:
            raise ValueError(f"the pipeline schedule was built for {self.shape.m} micro-batches, got {len(micro)}")
        handle = self._reduce_loss(self._run(self.actions, micro, train=True, loss_scale=loss_scale))
        return handle if async_loss else handle.wait()

    @torch.no_grad()
    def forward_only(self, micro: list[Batch]) -> torch.Tensor:
        """Evaluation: the mean loss over ``micro`` (every stage), no backward."""
        actions = build(
            self.schedule,
            Shape.of(self.schedule, self.shape.p, self.shape.v, len(micro)),
            forward_only=True,
            early_receives=self.early_receives,
        )[self.rank]
        return self._reduce_loss(self._run(actions, micro, train=False)).wait()

    def _reduce_loss(self, local: torch.Tensor):
        """Sums the last stage's mean loss over the pipeline group (the other stages hold zero)."""
        loss = local.reshape(1)
        handle = self.acts.all_reduce(loss, async_op=True)
        handle.result = loss.reshape(())
        return handle

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, lr: float, grad_clip: float = 0.0) -> float:
        """One optimizer step on a batch (cut into the schedule's micro-batches); returns its loss."""
        m = self.shape.m
        if tokens.shape[0] % m:
            raise ValueError(f"a batch of {tokens.shape[0]} rows does not cut into {m} micro-batches")
        self.engine.zero_grad()
        loss = self.forward_backward(list(zip(tokens.chunk(m), targets.chunk(m))), async_loss=True)
        self.engine.finish_backward()
        self.engine.clip_grad_norm(grad_clip)
        self.engine.step(lr)
        self.engine.balance_routers()  # auxiliary-loss-free balancing: this stage's routing biases follow the loads
        return float(loss.wait())

    # ---- the executor ----------------------------------------------------------------------
    def _run(
        self,
        actions: list[Action],
        micro: list[Batch],
        train: bool,
        loss_scale: float = 1.0,
        cache=None,
        start: int = 0,
    ) -> torch.Tensor:
        self._inbox, self._outbox, self._sending, self._local = {}, {}, [], {}
        self._total = torch.zeros((), device=self.device)
        self._logits = None
        alive = peak = 0
        trace = []
        t0 = self._trace_start()
        for run in batches(actions):
            a = run[0]
            if not a.is_compute:
                self._post(run, micro)
                continue
            key = (a.kind, a.chunk, a.micro)
            if self.early_receives and key in self._inbox:  # about to wait: the sends posted so far are done first
                self._finish_sends()
            received = self._received(key)  # waiting for it is idle time, not compute
            began = time.perf_counter()
            if a.kind == "F":
                self._forward(a, received, micro, train, loss_scale, cache, start)
                alive += train
                peak = max(peak, alive)
            elif a.kind == "B":
                self._backward(a, received)
                alive -= not self.split
            else:
                self._weight(a)
                alive -= 1
            if self.trace_enabled:
                trace.append((a, began - t0, time.perf_counter() - t0))
            self._sending = [(h, keep) for h, keep in self._sending if not h.done()]
        self._finish_sends()
        if train:
            self.peak_alive = peak
        if self.trace_enabled and train:
            self.last_trace = trace
        return self._total / len(micro)  # this stage's mean loss: zero but on the last stage

    def _finish_sends(self) -> None:
        """Waits for the sends in flight and drops their tensors (a stage's outputs among them).

        gloo reports a send complete only once it is waited for, so there the runner waits for its sends just before
        it waits for a message: by then its own receives are posted, and a peer posts all of its own before its
        first wait, which no computation before it can hold up -- so the send completes once the peer gets there
        (on NCCL :meth:`_run` drops each send as it reports done)."""
        for h, _ in self._sending:
            h.wait()
        self._sending = []

    def _trace_start(self) -> float:
        if self.trace_enabled:
            self.acts.barrier()  # the stages start their clocks together
        return time.perf_counter()

    def _expected(self, micro: list[Batch], i: int, decoding: bool) -> tuple[int, ...]:
        b, t = micro[i][0].shape[:2]
        if self.tp_ctx is not None:
            return self.tp_ctx.activation_shape(b, t, self.d_model, decoding)
        return (b, t, self.d_model)

    def _post(self, run: list[Action], micro: list[Batch]) -> None:
        """Starts one run of messages: a batch per group, nothing waited for."""
        for comm, kind in ((self.acts, "F"), (self.grads, "B")):
            ops = []
            for a in run:
                if a.kind[-1] != kind:
                    continue
                if a.kind.startswith("SEND"):
                    t = self._outbox.pop((kind, a.chunk, a.micro))
                else:
                    t = torch.empty(
                        self._expected(micro, a.micro, self._decoding), dtype=self.act_dtype, device=self.device
                    )
                ops.append((a, t))
            handles = comm.batch_p2p(
                [("send" if a.kind.startswith("SEND") else "recv", t, peer(a, self.shape, self.rank)) for a, t in ops]
            )
            for (a, t), h in zip(ops, handles):
                if a.kind.startswith("SEND"):
                    self._sending.append((h, t))  # the tensor lives until its send completes
                else:
                    self._inbox[(kind, a.chunk, a.micro)] = (t, h)

    def _received(self, key: tuple[str, int, int]) -> torch.Tensor | None:
        """The activation (or gradient) a compute action reads, once it has arrived; None if it reads none."""
        if key in self._local:
            return self._local.pop(key)
        if key not in self._inbox:
            return None
        buf, handle = self._inbox.pop(key)
        handle.wait()
        return buf

    def _forward(
        self,
        a: Action,
        received: torch.Tensor | None,
        micro: list[Batch],
        train: bool,
        loss_scale: float,
        cache,
        start: int,
    ) -> None:
        chunk = self.chunks[a.chunk]
        x, y, *rest = micro[a.micro]
        labels = rest[0] if rest else None  # hard-routed experts: the micro-batch's label ids
        documents = rest[1] if len(rest) > 1 else None  # packed documents: its document ids
        weight = rest[2] if len(rest) > 2 else None  # chat data: its loss weight (trickles.data.loader.weigh)
        inp = x.to(self.device, non_blocking=True) if chunk.first else received.requires_grad_(train)
        seq_len = x.shape[1]
        for ctx in (self.cp_ctx, self.tp_ctx):
            if ctx is not None:
                ctx.begin_forward(seq_len, decoding=self._decoding)
        target = y.to(self.device, non_blocking=True) if chunk.last and y is not None else None
        mtp = target is not None and chunk.model.mtp is not None  # multi-token prediction reads the input ids
        extra = {"tokens": x.to(self.device, non_blocking=True)} if mtp else {}
        if documents is not None:
            extra["documents"] = documents  # (moved by the mask)
        with self.autocast():
            out = self.engine.run_chunk(chunk, lambda: chunk(inp, seq_len, cache, start, labels, target, **extra))
        if self.tp_ctx is not None:
            self.tp_ctx.end_forward()
        if chunk.last:
            if y is None:  # decoding: keep the last position's logits
                self._logits = out[:, -1:].float()
                return
            loss = out if weight is None else out * weight
            self._total += loss.detach()
            out = loss * (loss_scale / self.shape.m)
        else:
            expected = self._expected(micro, a.micro, self._decoding)
            if tuple(out.shape) != expected or out.dtype != self.act_dtype:
                raise RuntimeError(
                    f"pipeline stage {self.shape.stage(self.rank, a.chunk)} produced {tuple(out.shape)} "
                    f"{out.dtype}, but the next stage expects {expected} {self.act_dtype}"
                )
            self._hand_over(a, out.detach())
        if train:  # a stage's output is kept as its place in the graph only: its storage goes once it is sent
            self._saved[(a.chunk, a.micro)] = (None if chunk.first else inp, out if chunk.last else _edge(out))

    def _hand_over(self, a: Action, t: torch.Tensor) -> None:
        """``a``'s output to the outbox, or straight to the chunk of this rank that reads it."""
        reader = handoff(a, self.shape, self.rank)
        if reader is None:
            self._outbox[(a.kind, a.chunk, a.micro)] = t
        else:
            self._local[(reader.kind, reader.chunk, reader.micro)] = t

    def _backward(self, a: Action, grad: torch.Tensor | None) -> None:
        inp, out = self._saved.pop((a.chunk, a.micro))
        if self.split:
            self._weights[(a.chunk, a.micro)] = backward_input(out, grad, inp)
        else:
            with self.engine.micro_step(last=self.final_backward[a.chunk] == a.micro):
                torch.autograd.backward(out, grad)
        if inp is not None:
            self._hand_over(a, inp.grad)

    def _weight(self, a: Action) -> None:
        deferred = self._weights.pop((a.chunk, a.micro))
        with self.engine.micro_step(last=self.final_backward[a.chunk] == a.micro):
            backward_weight(deferred)

    # ---- decoding --------------------------------------------------------------------------
    @torch.no_grad()
    def last_logits(
        self, tokens: torch.Tensor, cache, start: int, vocab_local: int, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[B, 1, V]`` (this tensor-parallel rank's vocabulary shard) of the last position,
        on every stage: the stages run forward once, the last one broadcasts."""
        self._decoding = True
        try:
            actions = build(
                self.schedule,
                Shape.of(self.schedule, self.shape.p, self.shape.v, 1),
                forward_only=True,
                early_receives=self.early_receives,
            )[self.rank]
            self._run(
                actions,
                [(tokens, None) if labels is None else (tokens, None, labels)],
                train=False,
                cache=cache,
                start=start,
            )
            logits = self._logits
        finally:
            self._decoding = False
        if logits is None:
            logits = torch.empty((tokens.shape[0], 1, vocab_local), dtype=torch.float32, device=self.device)
        return self.acts.broadcast(logits, src=self.shape.owner(self.shape.stages - 1)[0])

    def gather_trace(self) -> Timeline | None:
        """Every stage's spans of the last traced step, on pipeline rank 0 (None elsewhere)."""
        import torch.distributed as dist

        rows = [[(a, s, e) for a, s, e in self.last_trace]]
        if self.acts.size > 1:
            out: list = [None] * self.acts.size
            dist.all_gather_object(out, rows[0], group=self.acts.group)
            rows = out
        return Timeline(rows) if self.rank == 0 else None


def _edge(out: torch.Tensor):
    """``out``'s place in the autograd graph (what its backward starts from), without its storage (Megatron's
    ``deallocate_output_tensor``; the stage's saved tensors are the graph's own)."""
    return get_gradient_edge(out) if out.grad_fn is not None else out


class PipelinedModel:
    """Looks like the whole model to :func:`~trickles.models.generate.generate`: each call runs the
    stages forward (with their own layers' KV cache) and returns the last position's logits."""

    def __init__(self, runner: PipelineRunner, model, vocab_local: int):
        self.runner, self.model, self.cfg, self.vocab_local = runner, model, model.cfg, vocab_local

    @property
    def training(self) -> bool:
        return self.model.training

    def eval(self):
        self.model.eval()
        return self

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def new_cache(self, batch: int, max_len: int):
        p = next(self.model.parameters())
        return self.model.new_cache(batch, max_len, dtype=p.dtype)

    def __call__(
        self, tokens: torch.Tensor, cache=None, start: int = 0, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.runner.last_logits(tokens, cache, start, self.vocab_local, labels)
