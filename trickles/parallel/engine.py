"""The contract between the trainer and a data-parallel strategy.

An :class:`Engine` owns how gradients are reduced over the data-parallel group, how the
optimizer updates the parameters, and how both are checkpointed. The trainer drives one
optimizer step as::

    engine.zero_grad()
    for i, batch in enumerate(micro_batches):
        with engine.micro_step(last=i == len(micro_batches) - 1):
            (loss(batch) / len(micro_batches)).backward()
    engine.finish_backward()          # wait for the reductions still in flight
    norm = engine.clip_grad_norm(max_norm)
    engine.step(lr)
    engine.balance_routers()          # mixture of experts: the routing biases follow the step's loads

With pipeline stages the loop over micro-batches is ``engine.pipeline.forward_backward``
(:class:`~trickles.parallel.pipeline.runner.PipelineRunner`), which wraps each backward in
``micro_step``, marking a chunk's last backward of the step as ``last``.

Implementations: :class:`~trickles.parallel.data.ddp.DataParallel` (ZeRO stage 0),
:class:`~trickles.parallel.data.zero.ZeroDataParallel` (stages 1 and 2) and
:class:`~trickles.parallel.data.zero3.Zero3DataParallel` (stage 3).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from ..comm import GroupComm
from ..models.routers import update_router_bias


class Engine:
    """Base class: data-parallel gradient reduction, optimizer step and checkpoint I/O.

    With tensor parallelism (``tp``: the tensor-parallel group), parameters this engine sees are
    the rank's tensor-parallel shards; gradients of parameters that every tp rank holds but
    uses on different data (``tp_spec.partial_grad``) are summed over ``tp`` after the
    data-parallel reduction, and the global gradient norm counts tp-replicated parameters once.

    With expert parallelism (``ep``: the ranks splitting the experts, ``edp``: the ranks holding the same
    experts; :mod:`trickles.parallel.expert`) the parameters fall in two groups (:attr:`groups`): the
    experts, averaged (and under ZeRO sharded) over ``edp``, and every other weight, over all of ``comm``
    (the replicas) as without experts.
    """

    stage: int = 0

    def __init__(
        self,
        model: nn.Module,
        comm: GroupComm,
        tp: GroupComm | None = None,
        ep: GroupComm | None = None,
        edp: GroupComm | None = None,
    ):
        self.model = model
        self.comm = comm
        self.tp = tp
        self.ep = ep if ep is not None and ep.size > 1 else None
        # each parameter's data-parallel group (group_of): the replicas; with expert parallelism the experts' edp
        self.groups: list[GroupComm] = [comm] if self.ep is None else [comm, edp]
        self._reduce = True
        self.full_logits = lambda logits: logits
        self.shard_sequence = lambda tokens: (
            tokens
        )  # context parallelism: this rank's tokens of [B, T] inputs and targets
        self.pipeline = None  # a PipelineRunner when the model is one stage of a pipeline
        self.stages: GroupComm | None = None  # the pipeline group: the gradient norm sums over it
        self._tied: list[nn.Parameter] = []
        self._tied_comm: GroupComm | None = None
        self._tied_counted = True
        self._deferred: set[int] = set()
        self._bound: set[int] = set()  # parameters whose .grad is their view of the gradient buffer
        # stacked expert weights [E, ...]: one norm unit per expert for LAMB and LARS (parallel.norms)
        self._stacked = {
            id(p) for m in model.modules() if getattr(m, "stacked", False) for p in m.parameters(recurse=False)
        }

    def group_of(self, p: torch.Tensor) -> int:
        """The index in :attr:`groups` of the ranks ``p``'s gradient is averaged (and its state sharded) over."""
        return 1 if self.ep is not None and _spec(p, "ep_sharded") else 0

    @property
    def group_ranks(self) -> list[int]:
        return [g.rank for g in self.groups]

    def tie_across_stages(self, params: list[nn.Parameter], comm: GroupComm, counted: bool) -> None:
        """``params`` have copies on other pipeline stages (over ``comm``): their gradients are summed
        there before the data-parallel reduction, and count in the gradient norm here if ``counted``.

        Their buckets are reduced once backward is over (:meth:`finish_backward`), not during it.
        """
        self._tied, self._tied_comm, self._tied_counted = list(params), comm, counted
        self.reduce_after_backward(params)

    def reduce_after_backward(self, params: list[nn.Parameter]) -> None:
        """The buckets holding ``params`` are reduced once backward is over (:meth:`finish_backward`), not as soon
        as a chunk's last backward has reached them: another chunk of this pipeline rank (ZB-V's two ends with a tied
        embedding) still adds to their gradients."""
        self._deferred |= {id(p) for p in params}

    # ---- gradients as views of a flat buffer ------------------------------------------------
    def _bind_grads(self, views: dict[int, torch.Tensor]) -> None:
        """Sets each parameter's ``.grad`` to its (zeroed) place in the flat gradient buffer where dtype
        and device agree, so that autograd adds every micro-batch's gradient into it in place (PyTorch
        DDP's ``gradient_as_bucket_view``) instead of handing over a fresh tensor to be added."""
        self._bound = set()
        for p in self.params:
            view = views.get(id(p))
            if view is not None and view.dtype == p.dtype and view.device == p.device:
                p.grad = view
                self._bound.add(id(p))
            else:
                p.grad = None

    def _accumulate(self, p: nn.Parameter, main: torch.Tensor) -> None:
        """In the post-accumulate-grad hook: makes ``main`` hold ``p``'s gradient summed over the micro-steps."""
        g = p.grad
        if not g.is_sparse and g.data_ptr() == main.data_ptr():
            return  # autograd accumulated into the view in place
        # (a sparse gradient: a tied embedding's looked-up rows, Transformer.embed_tokens, added below like any other)
        bound = id(p) in self._bound
        if bound and torch.is_grad_enabled():  # backward(create_graph=True) sums out of place: view + new
            main.copy_(g)
        else:  # a fresh gradient: the parameter was not bound, or its .grad was reset from outside
            main.add_(g)
        p.grad = main if bound else None

    def accumulated_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The whole gradient of ``p`` accumulated over this step's micro-batches, before any reduction."""
        raise NotImplementedError(f"{type(self).__name__} keeps no whole gradient per parameter")

    @contextlib.contextmanager
    def micro_step(self, last: bool):
        """Backward inside this block belongs to one micro-batch; ``last`` marks the step's final one."""
        self._reduce = last
        self._begin_micro_step(last)
        yield
        self._end_micro_step(last)
        self._reduce = True

    def _begin_micro_step(self, last: bool) -> None:
        pass

    def run_chunk(self, chunk, call):
        """Runs a pipeline chunk's forward, ``call()``, and returns its output; an engine that must prepare the
        parameters the chunk reads outside its blocks (the embedding, the head) wraps it."""
        return call()

    def _end_micro_step(self, last: bool) -> None:
        pass

    def finish_backward(self) -> None:
        """Sums gradients tied across pipeline stages, waits for the data-parallel reductions still in
        flight and completes tensor-parallel partial gradients."""
        if self._tied_comm is not None:
            for p in self._tied:
                self._tied_comm.all_reduce(self.accumulated_grad(p))
        self._finish_reduction()
        if self.tp is not None and self.tp.size > 1:
            partial = [g for p, g in self.owned_param_grads() if _spec(p, "partial_grad")]
            if partial:
                flat = torch.cat([g.reshape(-1) for g in partial])
                self.tp.all_reduce(flat)
                torch._foreach_copy_(
                    partial, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in partial]), partial)]
                )
        if self.ep is not None:  # see trickles.parallel.expert: "Gradients"
            experts = [g for p, g in self.owned_param_grads() if self.group_of(p) == 1]
            if experts:
                torch._foreach_mul_(experts, 1.0 / self.ep.size)

    def _launch_ready(self, g: int) -> None:
        """Launches group ``g``'s complete buckets in index order, never one before a lower-numbered one: every rank
        then issues the same collectives in the same order even when their backward graphs differ (a mixture of
        experts skips the experts that got no token on one rank and not on another). For the bucketed engines:
        ``layout``, ``_pending`` (parameters still to report, per bucket), ``_next`` (per group) and ``_launch``."""
        end = self.layout.group_buckets[g].stop
        while self._next[g] < end and self._pending[self._next[g]] == 0:
            self._launch(self._next[g])
            self._next[g] += 1

    def _finish_reduction(self) -> None:
        raise NotImplementedError

    def owned_param_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(parameter, reduced gradient)`` for every parameter part this rank updates."""
        raise NotImplementedError

    def owned_grads(self) -> list[torch.Tensor]:
        return [g for _, g in self.owned_param_grads()]

    def scale_grads(self, factor: float) -> None:
        """Multiplies the reduced gradients by ``factor`` (unscaling a loss-scaled backward)."""
        grads = self.owned_grads()
        if grads:
            torch._foreach_mul_(grads, factor)
        self._scaled(torch.tensor(factor, dtype=torch.float32))

    def _scaled(self, factor: torch.Tensor) -> None:
        """The owned gradients were just multiplied by ``factor`` (an engine whose optimizer copied them away already
        passes it on)."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clips to ``max_norm`` by the global norm of all gradients; returns the norm (fp32, equal on all ranks).

        ``norm^2 = sum over owned parts of g^2`` (accumulated in fp32), summed over the dp ranks
        when gradients are sharded there (ZeRO >= 1), over the tp ranks, where tp-replicated
        parameters count on tp rank 0 only, and over the pipeline stages, where a weight tied
        across stages counts on one of them. With expert parallelism the sum always runs over the
        replicas (``comm``), every rank holding different experts: without ZeRO each weight counts
        on the first rank of its group. Every gradient is scaled by
        ``min(1, max_norm / (norm + 1e-6))`` (torch's ``clip_grad_norm_`` rule); ``max_norm <= 0``
        only measures. An inf or NaN anywhere makes the norm non-finite on every rank.
        """
        pairs = self.owned_param_grads()
        device = pairs[0][1].device if pairs else next(self.model.parameters()).device
        skip = set() if self._tied_counted else {id(p) for p in self._tied}
        counted = [g for p, g in pairs if id(p) not in skip and self.counts(p)]  # each part of the model once
        sq = torch.zeros((), device=device, dtype=torch.float32)
        if counted:
            sq = (torch.stack(torch._foreach_norm(counted, dtype=torch.float32)) ** 2).sum()
        sq = sq.reshape(1)
        self.sum_parts(sq)
        if self.stages is not None and self.stages.size > 1:
            self.stages.all_reduce(sq)
        norm = sq.sqrt().reshape(())
        grads = [g for _, g in pairs]
        if max_norm > 0 and grads:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
            self._scaled(coef)
        return norm

    def counts(self, p: torch.Tensor) -> bool:
        """Whether this rank's part of ``p`` counts in a sum over the model's parts (the gradient norm, LAMB's and
        LARS's per-weight norms), so that :meth:`sum_parts` counts every element once: what every tp rank holds
        alike counts on tp rank 0 (:meth:`writes`); without ZeRO, what every replica holds alike on the first of
        the ranks holding it (under expert parallelism only, where the sum runs over the replicas)."""
        return self.writes(p) and (self.stage >= 1 or self.ep is None or self.groups[self.group_of(p)].rank == 0)

    def sum_parts(self, t: torch.Tensor) -> None:
        """Sums per-rank partial sums ``t`` (fp32) in place over the ranks that hold the model's other parts: the
        replicas, where they hold different parts (ZeRO >= 1 shards, expert parallelism), then the tp group."""
        if (self.stage >= 1 or self.ep is not None) and self.comm.size > 1:
            self.comm.all_reduce(t)
        if self.tp is not None and self.tp.size > 1:
            self.tp.all_reduce(t)

    def norm_provider(self, named: list[tuple[str, nn.Parameter]], device: torch.device):
        """The per-weight norm provider over the parameters ``named`` (every one this engine holds), for LAMB and
        LARS (:class:`~trickles.parallel.norms.ShardNorms`)."""
        from .norms import ShardNorms

        return ShardNorms(named, self._stacked, self.counts, self.sum_parts, device)

    def step(self, lr: float) -> None:
        raise NotImplementedError

    def balance_routers(self, update: bool = True) -> None:
        """Auxiliary-loss-free balancing after a step (:func:`~trickles.models.routers.update_router_bias`): the
        routers' loads summed over the replicas (data, context and expert parallel) and the tensor-parallel ranks
        (sequence parallel: each routed its shard), so every rank moves the same bias alike. ``update=False`` (a
        skipped step): the step's loads are forgotten and the bias kept, without a collective."""
        update_router_bias(self.model, [self.comm, self.tp] if update else None)

    def zero_grad(self) -> None:
        raise NotImplementedError

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer as this rank holds it (whole under ZeRO-3: a collective)."""
        from ..train.checkpoint import unique_state

        return {k: v.detach() for k, v in unique_state(self.model).items()}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: ``{"parameters", "gradients", "optimizer"}``."""
        raise NotImplementedError

    def save(self, directory: str, rank: int) -> None:
        """Writes this rank's part of the model and optimizer state into ``directory`` (:meth:`checkpoint_files`)."""
        from ..train.checkpoint import save_pieces

        for name, tensors in self.checkpoint_files(rank).items():
            save_pieces(tensors, f"{directory}/{name}")

    def checkpoint_files(self, rank: int) -> dict[str, dict]:
        """``{file name: {key: (tensor, piece description)}}``: what this rank writes into a checkpoint (the tensors
        themselves, not copies).

        Parameters are replicated over the data-parallel ranks (ZeRO 0-2): the first rank of each
        parameter's group writes it. Optimizer state is written by every rank when it is sharded
        (ZeRO >= 1), else by the first one too.
        """
        out = {
            f"model-rank{rank:05d}.safetensors": self._model_tensors(),
            f"optimizer-rank{rank:05d}.safetensors": self.optimizer.state_tensors(
                lambda p: self.writes(p) and (self.stage >= 1 or self._first_of_group(p))
            ),
        }
        return {name: tensors for name, tensors in out.items() if tensors}

    def _model_tensors(self) -> dict:
        from ..train.checkpoint import model_pieces

        return model_pieces(self.model, lambda p: self.writes(p) and self._first_of_group(p))

    def load(self, directory: str) -> None:
        """Restores model and optimizer state from a checkpoint directory (any data-parallel layout)."""
        from ..train.checkpoint import PieceReader, load_model_state

        load_model_state(self.model, PieceReader(directory, "model"), directory, part=self.pipeline is not None)
        self._load_optimizer(directory)

    def placements(self) -> dict[str, object]:
        """``{name: TPSpec or None}`` for every parameter in :meth:`full_state`: where its tensor sits in the global
        one."""
        return {n: getattr(p, "tp_spec", None) for n, p in self.model.named_parameters()}

    # ---- shared checkpoint pieces ----------------------------------------------------------
    def writes(self, p: torch.Tensor) -> bool:
        """Whether this rank, of the tensor-parallel ranks, writes its copy of ``p`` to checkpoints and counts it
        in the gradient norm: what every tp rank holds alike, tp rank 0 does; a block some of them hold alike (a
        tensor-parallel grid's, :mod:`~trickles.parallel.tensor.grid_linear`), the one its spec calls ``primary``."""
        if self.tp is None or self.tp.rank == 0:
            return True
        return not _spec(p, "replicated", default=True) and _spec(p, "primary")

    def _first_of_group(self, p: torch.Tensor) -> bool:
        """Whether this rank is the first of the data-parallel ranks holding the same whole ``p``."""
        return self.groups[self.group_of(p)].rank == 0

    def _load_optimizer(self, directory: str) -> None:
        from ..train.checkpoint import PieceReader

        self.optimizer.load_state(PieceReader(directory, "optimizer"))


def _spec(p, attr: str, default: bool = False) -> bool:
    spec = getattr(p, "tp_spec", None)
    return default if spec is None else getattr(spec, attr)


def weak_method(method):
    """A callable that forwards to a bound ``method`` without keeping its object alive.

    Hooks live on tensors inside autograd (C++), where Python's garbage collector cannot see
    the cycle ``parameter -> hook -> engine -> parameter``; a strong reference would leak the
    engine and everything it holds.
    """
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        m = ref()
        return m(*args, **kwargs) if m is not None else None

    return call


def trainable_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """:func:`unique_named_parameters` that train: a frozen one (``requires_grad=False``: a LoRA run's base, see
    :mod:`trickles.adapters`) gets no gradient buffer, reduction or optimizer state, and stays whole on each rank."""
    return [(n, p) for n, p in unique_named_parameters(model) if p.requires_grad]


def unique_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen, out = set(), []
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out
