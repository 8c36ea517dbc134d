"""Data parallelism (ZeRO stage 0): every rank holds everything, gradients are averaged.

Each of the ``dp`` ranks runs forward and backward on its own slice of the global batch; the
gradients are then averaged so that every replica applies the update one process would make
on the whole batch (the loss being a mean over equally sized slices).

* :func:`average_gradients`, the naive form: one all-reduce per parameter after backward. It is
  the oracle the bucketed form is tested against.
* :class:`DataParallel`, the bucketed, overlapped form. Gradients accumulate into one flat
  buffer laid out by :class:`~trickles.parallel.flat.FlatLayout` (reverse parameter order,
  buckets of ``bucket_bytes``). A post-accumulate-grad hook adds each parameter's gradient into
  its place; on the last accumulation micro-step, a bucket whose parameters have all reported is
  all-reduced (mean) asynchronously while backward goes on. Earlier micro-steps only
  accumulate. Per step each rank sends ``2 (dp-1)/dp * 4 * P`` bytes in fp32.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..comm import GroupComm, Handle
from ..optim.adamw import AdamWSettings, adamw_kwargs, param_groups
from ..train import checkpoint as ckpt
from .engine import FIRST_BUCKET_BYTES, Engine, weak_method, unique_named_parameters
from .flat import FlatLayout


def average_gradients(params: Iterable[torch.nn.Parameter], comm: GroupComm) -> None:
    """``p.grad <- mean over the group of p.grad`` for every parameter that has a gradient."""
    if comm.size == 1:
        return
    for p in params:
        if p.grad is not None:
            comm.all_reduce(p.grad, op="mean")


class DataParallel(Engine):
    """Replicated parameters and optimizer; bucketed all-reduce of gradients overlapping backward."""

    stage = 0

    def __init__(self, model: nn.Module, comm: GroupComm, optim: AdamWSettings, bucket_bytes: int | None):
        super().__init__(model, comm)
        self.named = unique_named_parameters(model)
        self.params = [p for _, p in self.named]
        device = self.params[0].device
        self.optimizer = torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=optim.lr, betas=optim.betas,
                                           eps=optim.eps, **adamw_kwargs(device))
        self.bucketed = comm.size > 1
        if self.bucketed:
            self.layout = FlatLayout(self.named, comm.size, bucket_bytes, first_bucket_bytes=FIRST_BUCKET_BYTES)
            self.grad_buffer = torch.zeros(self.layout.total, dtype=self.params[0].dtype, device=device)
            self.main_grads = dict(zip((id(s.param) for s in self.layout.slots), self.layout.views(self.grad_buffer)))
            self._bucket_of = {id(s.param): s.bucket for s in self.layout.slots}
            self._pending: list[int] = []
            self._handles: dict[int, Handle] = {}
            for p in self.params:
                p.register_post_accumulate_grad_hook(weak_method(self._on_grad))

    # ---- backward ------------------------------------------------------------------------
    def _begin_micro_step(self, last: bool) -> None:
        if self.bucketed and last:
            self._pending = [len(b.slots) for b in self.layout.buckets]
            self._handles = {}

    def _on_grad(self, p: torch.Tensor) -> None:
        self.main_grads[id(p)].add_(p.grad)
        p.grad = None
        if self._reduce:
            b = self._bucket_of[id(p)]
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        self._handles[b] = self.comm.all_reduce(self.grad_buffer[bucket.start:bucket.end], op="mean", async_op=True)

    def finish_backward(self) -> None:
        if not self.bucketed:
            return
        for b in range(len(self.layout.buckets)):  # buckets with a parameter that got no gradient
            if b not in self._handles:
                self._launch(b)
        for h in self._handles.values():
            h.wait()
        self._handles = {}
        for p in self.params:
            p.grad = self.main_grads[id(p)]

    # ---- update --------------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm > 0 else float("inf"), foreach=True)

    def step(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.bucketed:
            self.grad_buffer.zero_()
            self._begin_micro_step(last=True)  # a plain backward() after zero_grad() also reduces

    # ---- accounting and checkpoints ------------------------------------------------------
    def memory(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.params)
        if self.bucketed:
            grads = self.grad_buffer.numel() * self.grad_buffer.element_size()
        else:
            grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        opt = sum(t.numel() * t.element_size() for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t))
        return {"parameters": params, "gradients": grads, "optimizer": opt}

    def save(self, directory: str, rank: int) -> None:
        if rank != 0:
            return
        ckpt.save_tensors(ckpt.unique_state(self.model), f"{directory}/model.safetensors")
        names = {id(p): n for n, p in self.named}
        ckpt.save_tensors(ckpt.optimizer_tensors(self.optimizer, names), f"{directory}/optimizer.safetensors")

    def load(self, directory: str) -> None:
        ckpt.load_model_state(self.model, ckpt.SliceReader(directory, "model"), directory)
        reader = ckpt.SliceReader(directory, "optimizer")
        names = {id(p): n for n, p in self.named}
        state = {}
        for n, _ in self.named:
            if f"{n}/exp_avg" in reader:
                state.update({f"{n}/{k}": reader.read(f"{n}/{k}") for k in ("exp_avg", "exp_avg_sq", "step")})
        ckpt.load_optimizer_tensors(self.optimizer, names, state, directory)
