"""The training loop, assembled from the public pieces a user could call directly.

One optimizer step (``Trainer.train_step``):

1. the step's global batch is samples ``consumed .. consumed + global_batch`` (a pure function
   of seed and position); this data-parallel rank takes its ``global_batch / dp`` rows and cuts
   them into ``accumulation`` micro-batches (with context parallelism, each cp rank keeps its
   tokens of every sequence: :func:`trickles.parallel.sequence.shard_sequence`);
2. each micro-batch runs forward (under the precision policy) and backward on
   ``loss / accumulation``, so the summed gradient is that of the mean loss;
3. the data-parallel engine (:func:`trickles.parallel.plan.parallelize`: replicated, or ZeRO
   stage 1-3) averages the gradients over the data-parallel group (``dp x cp`` with context parallelism) --
   overlapping backward -- clips them to ``grad_clip`` by global norm and runs AdamW with the scheduled learning rate.

With pipeline stages (``parallel.pp > 1``) step 2 is the engine's
:class:`~trickles.parallel.pipeline.runner.PipelineRunner`: the micro-batches are the pipeline's,
and its schedule interleaves their forwards and backwards across the stages.

The loop around it evaluates on held-out data, writes ``metrics.jsonl``, shows its progress (a bar on a terminal,
plain lines elsewhere) and saves checkpoints; how a run ends -- its final save, a SIGTERM's stop, the exit status of
each -- is :mod:`trickles.train.stopping`, what it leaves besides (plots, a sample) :mod:`trickles.train.outputs`.
What a checkpoint holds beside the engine's shards, and how a run resumes from one (position, loss scaler, RNG), is
:mod:`trickles.train.trainer_state`.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from ..adapters.lora import apply_lora
from ..comm import flight
from ..compress.distill import Distiller
from ..compress.qat import apply_qat
from ..config import Config
from ..data import build_tokenizer
from ..data.loader import DOCUMENTS, weigh
from ..data.mixture import MixedBatches, data_batches, load_data, overlong_counts
from ..data.sources import iter_documents
from ..errors import ConfigError, TrainingStopped
from ..kernels.cross_entropy import OutputLoss
from ..memory.precision import autocast, policy
from ..memory.scaler import DynamicLossScaler
from ..models.config import ModelConfig, resolve_model
from ..models.transformer import Transformer, count_params
from ..optim import lr_at
from ..optim.schedule import schedule_kind
from ..parallel.plan import parallelize
from ..topology import Topology
from . import outputs, sampling, stopping, trainer_state
from .flops import flops_per_token, matmul_params, peak_flops
from .load import load_for_inference  # noqa: F401 (re-exported: trickles.train.trainer.load_for_inference)
from .metrics import MetricsLog, moe_metrics
from .progress import CompileReport, Progress, run_line
from .saver import Saver, probe_writable


class Trainer:
    """Builds data, model and optimizer for ``cfg`` on ``topo`` and trains them."""

    def __init__(self, cfg: Config, topo: Topology, quiet: bool = False):
        self.cfg, self.topo = cfg, topo
        self.quiet = quiet or not topo.is_main
        self.device = topo.device
        t = cfg.train
        self.micro_batch, self.accumulation = cfg.batch_plan(topo.dims.dp)
        self.dp = topo.comm("dp")  # which rows of the global batch this rank reads
        self.replicas = topo.replicas()  # the ranks averaging gradients and losses (dp, or dp x cp)
        torch.manual_seed(t.seed)

        # Data: rank 0 trains/tokenizes into the cache first, the others then read it (for as long as that
        # takes: the hang watchdog leaves waits for another rank's file work to the process group's timeout).
        world = topo.comm("world")
        if not topo.is_main:
            world.barrier(limit_s=math.inf)
        self.tokenizer = build_tokenizer(cfg.data, documents=lambda: iter_documents(cfg.data))
        hard = cfg.model.moe_experts and cfg.model.moe_router == "hard"
        self.label_names = list(cfg.model.label_experts) if hard else None  # hard-routed experts' labels, by id
        self.corpus = load_data(cfg.data, self.tokenizer, self.label_names)  # a Corpus, or a Mixture of sources
        if topo.is_main:
            world.barrier(limit_s=math.inf)
        seq = cfg.data.seq_len
        eos = self.tokenizer.eos_id if cfg.data.document_mask else None  # packed documents: batches carry their ids
        self.train_data, self.val_data = data_batches(self.corpus, seq, t.seed, self.dp.rank, self.dp.size, eos)
        self.source_val_loss: dict[str, float] = {}  # a mixture's last validation loss by source

        # Model, built without memory, then allocated and wrapped by the parallel plan.
        self.model_cfg: ModelConfig = resolve_model(cfg.model, self.tokenizer.vocab_size, seq)
        with torch.device("meta"):
            model = Transformer(self.model_cfg)
        self.n_params = count_params(model)
        self.moe_stats = model.moe_stats  # what the mixture-of-experts blocks report (None without experts)
        # a mixture of experts: parameters a token passes through (the router and top-k of the experts)
        self.n_active = self.n_params - (matmul_params(self.model_cfg, active=False) - matmul_params(self.model_cfg))
        init = trainer_state.init_source(t.init_from, model, t.seed) if t.init_from else None  # its weights
        self.lora = t.lora()  # LoRA: adapters on the targets, every base parameter frozen (trickles.adapters)
        if self.lora is not None:
            apply_lora(model, self.lora)
        self.engine = parallelize(model, topo, cfg, t.seed, init=init)
        self.model = self.engine.model
        self.pipeline = self.engine.pipeline  # a PipelineRunner when parallel.pp > 1
        if self.pipeline is not None:
            self.pipeline.trace_enabled = bool(t.pipeline_trace)
        if t.qat:  # fake int8 in every projection's forward (trickles.compress.qat)
            apply_qat(self.model)
        if t.compile:
            for block in self.model.layers.values():
                block.compile()
            loss = getattr(self.model, "loss", None)  # a pipeline's first stages have none
            if type(loss) is OutputLoss:  # the output projection and loss (a vocabulary-parallel one communicates)
                loss.compile()

        self.distill = None  # the distillation loss (distill.teacher), trickles.compress.distill
        if cfg.distill.teacher:
            self.distill = Distiller(cfg.distill, self.model_cfg, self.device, t.seed, t.weight_decay)

        self.scaler = None
        if policy(cfg.memory.precision, cfg.memory.grad_dtype).needs_loss_scaling:
            m = cfg.memory
            self.scaler = DynamicLossScaler(
                m.loss_scale, m.loss_scale_growth_interval, m.loss_scale_hysteresis, m.loss_scale_min
            )
        self.step = 0
        self.consumed = 0
        self.skipped = 0  # optimizer steps skipped for non-finite gradients
        self._bad_streak: list[int] = []  # consecutive steps whose loss or gradients were not finite
        self.flops_per_token = flops_per_token(self.model_cfg, seq, self.lora)  # LoRA: the FLOPs its step needs
        self.peak = peak_flops(self.device, cfg.memory.precision)
        self.ckpt_dir = os.path.join(t.out_dir, "checkpoints")
        probe_writable(self.ckpt_dir, self.topo.rank)  # a read-only or missing filesystem: now, not at the first save
        self.saver = Saver(
            self.topo,
            t.async_checkpoint,
            t.max_failed_saves,
            cfg.parallel.timeout_s,
            say=lambda line: None if self.quiet else print(line, flush=True),
        )
        self.history: list[dict[str, Any]] = []
        self.stop_requested = None  # () -> bool: this process was asked to stop (trickles.process.stop_requested)

    # ---- one step ------------------------------------------------------------------------
    def _loss(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        labels: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        weight: float | None = None,
        train: bool = False,
    ) -> torch.Tensor:
        """The micro-batch's training loss (``train``: with distillation, its loss) or cross-entropy, times ``weight``
        (chat data: :func:`~trickles.data.loader.weigh`)."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        extra = {} if documents is None else {"documents": documents}  # (on the host: the mask moves what it needs)
        with autocast(self.cfg.memory.precision, self.device):
            if train and self.distill is not None:
                return self.distill.loss(self.model, x, y, labels)
            loss = self.model(x, labels=labels, target=y, **extra)
        return loss if weight is None else loss * weight

    def _shard(self, micro: list, total: int | None = None) -> list:
        """With context parallelism, this rank's tokens of each micro-batch's inputs and targets (and label ids); the
        document ids stay whole: every rank's attention masks need the other ranks' ids too. ``total``: the global
        batch's trained targets (chat data), each micro-batch's loss weight appended (:func:`weigh`)."""
        cut = self.engine.shard_sequence
        micro = [tuple(t if t is None or i == DOCUMENTS else cut(t) for i, t in enumerate(batch)) for batch in micro]
        return weigh(micro, total, self.replicas.size)

    def train_step(self) -> dict[str, Any]:
        """Runs one optimizer step on the next global batch; returns its metrics."""
        t = self.cfg.train
        start = time.perf_counter()
        flight.step = self.step + 1  # named in hang reports
        lr = lr_at(self.step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, schedule_kind(t), t.poly_power)
        total = torch.zeros((), device=self.device)
        data, b = self.train_data, t.global_batch
        batches = self._shard(
            data.micro_batches(self.consumed, b, self.micro_batch), data.trained_targets(self.consumed, b)
        )
        scale = self.scaler.scale if self.scaler else 1.0
        moe = self.moe_stats
        if moe is not None:  # the experts' auxiliary losses backpropagate scaled like the loss
            moe.reset()
            moe.grad_scale = scale / self.accumulation
        self.engine.zero_grad()
        pipeline_loss = None
        if self.pipeline is not None:  # the schedule runs every micro-batch's forward and backward
            pipeline_loss = self.pipeline.forward_backward(batches, scale, async_loss=True)
        for i, batch in enumerate(batches if self.pipeline is None else []):
            with self.engine.micro_step(last=i == len(batches) - 1):
                loss = self._loss(*batch, train=True)
                (loss * (scale / self.accumulation)).backward()
            total += loss.detach()
        self.engine.finish_backward()
        if self.distill is not None:
            self.distill.reduce(self.replicas)
        if scale != 1.0:
            self.engine.scale_grads(1.0 / scale)
        grad_norm = float(self.engine.clip_grad_norm(t.grad_clip))  # one all-reduce: every rank sees the same norm
        finite = math.isfinite(grad_norm)
        if finite:
            self.engine.step(lr)
        else:
            self.skipped += 1
        self.engine.balance_routers(update=finite)  # auxiliary-loss-free balancing moves the routing biases
        if self.distill is not None:  # a learned hidden-state projection steps with the model (or drops its gradients)
            self.distill.step(lr, scale, skip=not finite)
        if self.scaler:
            self.scaler.update(overflow=not finite)
        if pipeline_loss is not None:  # summed over the stages in the background meanwhile
            total = pipeline_loss.wait() * self.accumulation
        loss = self.replicas.all_reduce(total / self.accumulation, op="mean")
        loss_value = loss.item()
        self._guard(loss_value, finite)
        elapsed = time.perf_counter() - start
        self.step += 1
        self.consumed += t.global_batch
        tokens = t.global_batch * self.cfg.data.seq_len
        flops = self.flops_per_token * tokens / elapsed
        record = {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / elapsed,
            "flops_per_s": flops,
            "mfu": flops / (self.peak * self.topo.world_size) if self.peak else None,
            "step_time": elapsed,
            "consumed_samples": self.consumed,
            "skipped": not finite,
            "skipped_total": self.skipped,
        }
        if self.scaler:
            record["loss_scale"] = scale
        if isinstance(self.train_data, MixedBatches):  # tokens drawn from (and trained on) each source so far
            record.update(self.train_data.source_counts(self.consumed))
        record.update(overlong_counts(self.corpus))  # chat data: conversations cut or dropped while packing
        if moe is not None:
            record.update(moe_metrics(moe, self.model_cfg, self.topo, self.cfg.parallel.sequence_parallel, self.device))
        return record

    def _guard(self, loss: float, finite_grads: bool) -> None:
        """Stops training when the loss or gradients stay non-finite; skipped steps changed nothing.

        An fp16 gradient overflow with a finite loss is the loss scaler's business, unless the
        scale is already at its minimum.
        """
        bad = not math.isfinite(loss) or (not finite_grads and (self.scaler is None or self.scaler.at_minimum))
        self._bad_streak = self._bad_streak + [self.step + 1] if bad else []
        limit = self.cfg.train.max_nonfinite_steps
        if len(self._bad_streak) >= limit:
            first = self._bad_streak[0]
            raise TrainingStopped(
                f"the loss or gradients were not finite for {limit} consecutive steps ({first}-{self.step + 1}, "
                f"last loss {loss}); "
                f"those updates were skipped and nothing was saved after step {first - 1}; lower train.lr, raise "
                f"train.warmup_steps, use memory.precision=bf16 or fp32, or check the data"
            )

    def evaluate(self) -> float | None:
        """Mean loss over ``eval_batches`` held-out batches (None when there is no held-out data); a mixture's is its
        sources' losses (``eval_batches`` of each, kept in ``source_val_loss``) weighted by their shares."""
        if not isinstance(self.val_data, dict):
            return self.held_out_loss(self.val_data)
        self.source_val_loss = {name: self.held_out_loss(data) for name, data in self.val_data.items()}
        return self.corpus.weighted(self.source_val_loss)

    @torch.no_grad()
    def held_out_loss(self, data) -> float | None:
        """Mean loss over ``eval_batches`` batches of ``data`` (held-out ShardedBatches; None: returns None)."""
        if data is None:
            return None
        t = self.cfg.train
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        for i in range(t.eval_batches):
            micro = self._shard(
                data.val_micro_batches(i, t.global_batch, self.micro_batch), data.val_trained_targets(i, t.global_batch)
            )
            if self.pipeline is not None:
                total += self.pipeline.forward_only(micro) * len(micro)
                count += len(micro)
                continue
            for batch in micro:
                total += self._loss(*batch)
                count += 1
        self.model.train()
        return self.replicas.all_reduce(total / max(count, 1), op="mean").item()

    # ---- the loop ------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Trains until ``train.steps``; returns the per-step metrics of this call."""
        t = self.cfg.train
        log = (
            MetricsLog(t.out_dir, resume_step=self.step if self.step else None, tensorboard=t.tensorboard)
            if self.topo.is_main
            else None
        )
        if not self.quiet:
            print(run_line(self))
        progress = Progress(self.step, t.steps, self.quiet, "distill loss" if self.distill is not None else "loss")
        compile_report = CompileReport(t.compile and not self.quiet)
        self.saver.record = log.write if log is not None else None
        if not self.quiet:
            self.saver.say = progress.write
        try:
            self._loop(log, progress, compile_report)
        except BaseException:
            self.saver.abandon()  # this rank's write finishes; the other ranks may be gone
            raise
        progress.close()
        outputs.finish(self, log)  # the pipeline trace, the plots, the sample
        return self.history

    def _loop(self, log, progress, compile_report) -> None:
        """Steps until ``train.steps``: metrics, evaluation and checkpoints as configured."""
        t = self.cfg.train
        while self.step < t.steps:
            started = time.perf_counter()
            record = self.train_step()
            compile_report.step_done(time.perf_counter() - started, progress.write)
            last = self.step == t.steps
            if t.eval_every and (self.step % t.eval_every == 0 or last):
                record["val_loss"] = self.evaluate()
                if self.source_val_loss:
                    record["source_val_loss"] = self.source_val_loss
            self.history.append(record)
            if log is not None:
                log.write(record)
            progress.step(self.step, record, self.skipped, self.scaler.scale if self.scaler else None)
            stopping.after_step(self, last)  # checkpoints, the final save, a SIGTERM's stop

    def sample(self, prompt: str, n_tokens: int, label: str | None = None) -> str:
        """Prompt plus ``n_tokens`` sampled from the current model (:func:`trickles.train.sampling.sample`)."""
        return sampling.sample(self, prompt, n_tokens, label)

    def label_ids(self, label: str, rows: int = 1) -> torch.Tensor:
        """``[rows]`` label ids of ``label`` for hard-routed experts; ConfigError naming the labels when unknown."""
        if label not in self.label_names:
            raise ConfigError(
                f"unknown label {label!r}; the experts are mapped for {', '.join(self.label_names)} "
                f"(model.moe_label_experts)"
            )
        return torch.full((rows,), self.label_names.index(label), dtype=torch.long, device=self.device)

    # ---- checkpoints (trickles.train.trainer_state) ---------------------------------------
    def save_checkpoint(self, wait: bool = True, final: bool = False) -> str | None:
        """Writes ``<out_dir>/checkpoints/step_N`` atomically (every rank its part; :mod:`trickles.train.saver`);
        returns its path on rank 0 once written. ``wait=False``: the write goes on in the background (where
        ``train.async_checkpoint`` allows) and None is returned. A failed save is logged and counted, not raised, until
        ``train.max_failed_saves`` fail in a row; a ``final`` one is verified and raises SavesFailed when it fails."""

        def take(tmp: str):
            return trainer_state.snapshot(
                tmp,
                self.topo,
                self.engine,
                self.tokenizer,
                self.cfg,
                self.model_cfg,
                self.scaler,
                step=self.step,
                consumed=self.consumed,
                skipped=self.skipped,
                device=self.device,
            )

        return self.saver.save(take, self.ckpt_dir, self.step, wait, final)

    def load_checkpoint(self, path: str, verify: bool = True) -> None:
        """Restores model, optimizer, position and RNG from ``path`` (a step_N directory, any dp layout)."""
        self.step, self.consumed, self.skipped = trainer_state.load(
            path, self.engine, self.scaler, self.topo.rank, self.model_cfg, self.cfg.train.optimizer, verify
        )
