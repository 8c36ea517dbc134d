"""Layer streaming: generate with a model larger than the device's memory.

:func:`load_streaming` builds the model on the meta device, sizes its parts, asks
:func:`~trickles.infer.placement.plan_placement` which blocks stay resident and which stream,
and materializes the embeddings, the final norm, the output projection and the resident blocks
on the device from the checkpoint's safetensors files, one tensor at a time. The streamed blocks
keep meta parameters; a :class:`BlockStreamer` gives each one its weights just before it runs.

**Where a streamed block's weights come from.** Whole tensors of a checkpoint (a one-process run,
or one consolidated with ``trickles checkpoint export``) are read through memory maps of the
safetensors files (:mod:`.mapped`, ``torch.UntypedStorage.from_file``): file-backed pages the kernel can drop,
not anonymous memory. On CPU a streamed block is copied from those maps straight into a buffer;
on CUDA each streamed block is packed once, at load, into pinned host memory, so its copy is one
asynchronous transfer. A tensor stored in pieces (tensor-parallel blocks, ZeRO flat ranges) is
read through :class:`~trickles.train.pieces.PieceReader` instead, at each use on CPU.

**The two buffers.** Every streamed block is laid out (each tensor 64-byte aligned) in a flat
byte buffer as large as the largest streamed block; there are two (one if a single block
streams), so at most two streamed blocks occupy device memory at a time. When streamed block
``i`` starts, its buffer is waited for, its parameters become views into it, and the copy of the
next streamed block (cyclically: after the last comes the first, for the next token) starts
into the other buffer -- on CUDA on a side stream (``non_blocking`` from pinned memory; an event
makes the copy wait until the block that last used that buffer has finished, another makes the
compute stream wait for the copy), on CPU on a copy thread (NumPy's copy, single-threaded, releases the GIL).
When the block ends its parameters go back to meta tensors.

The streamed model computes exactly what the resident one does: the same weights, bit for bit,
go through the same operations. So it is built as the resident model is
(:func:`~trickles.compress.checkpoint.load_checkpoint`): a float model computes its projections fused or apart as
its ``model.fused_proj`` says (unset: fused where the kernels' rule turns fusion on -- ``kernels=triton``, or a
measured win on CUDA -- for a model on the CPU as well), a quantized one apart. The fused and the separate
projections do not round alike (the fused gate/up output hands SiLU a stride-2 view, which takes another code path
than a contiguous tensor), so a
streamed model that kept them apart would drift from a fused resident one in the last bits. A fused block's buffer
holds the fused weights: a checkpoint written by a fused model stores them so (copied whole); from one that stores
the parts, each part's rows are copied into their place among the interleaved groups
(:mod:`trickles.models.fused`).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from ..data.tokenizers import load_tokenizer
from ..errors import UserError
from ..models.config import ModelConfig
from ..models.transformer import Transformer
from ..train import checkpoint as ckpt
from ..train.pieces import fused_layout
from .mapped import CheckpointTensors, _copy_one_thread, checkpoint_key
from .placement import Placement, plan_placement

__all__ = [
    "checkpoint_key",
    "CheckpointTensors",
    "BlockStreamer",
    "load_streaming",
    "kv_cache_bytes",
    "block_bytes",
    "prompt_length",
    "save_for_inference",
    "ALIGN",
]

ALIGN = 64  #: byte alignment of each tensor inside a block's buffer


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _state(module: nn.Module):
    """What a module's forward reads from its checkpoint: its parameters and persistent buffers (an int8 layer's codes
    and scales, :mod:`trickles.compress.quantize`), by name."""
    return module.state_dict(keep_vars=True).items()


class _Layout:
    """Where each tensor of a block sits in a flat byte buffer: ``(module, attr, checkpoint key, shape, dtype, offset,
    bytes, fused layout)`` (the last None but for a fused projection's tensor)."""

    def __init__(self, block: nn.Module, prefix: str):
        self.entries = []
        off = 0
        for name, p in _state(block):
            mod_name, _, attr = name.rpartition(".")
            mod = block.get_submodule(mod_name) if mod_name else block
            nbytes = p.numel() * p.element_size()
            self.entries.append(
                (mod, attr, checkpoint_key(prefix + name), tuple(p.shape), p.dtype, off, nbytes, fused_layout(p))
            )
            off = _aligned(off + nbytes)
        self.nbytes = off

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + nb].view(dt).view(shape) for _, _, _, shape, dt, o, nb, _ in self.entries]


def _slot_of(mod: nn.Module, attr: str) -> dict:
    """The dictionary of ``mod`` that holds ``attr``: its parameters or its buffers."""
    return mod._parameters if attr in mod._parameters else mod._buffers


class BlockStreamer:
    """Gives streamed blocks their weights from up to two reusable device buffers, prefetching the next one.

    ``blocks``: the streamed blocks by index (meta parameters); ``placement``: the plan.
    Counters: :attr:`copies` (blocks copied in) and :attr:`bytes_copied`.
    """

    def __init__(
        self, blocks: dict[int, nn.Module], placement: Placement, tensors: CheckpointTensors, device: torch.device
    ):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.order = list(placement.streamed)
        self.tensors = tensors
        self.layouts = {i: _Layout(blocks[i], f"layers.{i}.") for i in self.order}
        self.meta = {
            i: [(mod, attr, _slot_of(mod, attr)[attr]) for mod, attr, *_ in self.layouts[i].entries] for i in self.order
        }
        self.slots = [
            torch.empty(placement.buffer_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(placement.n_buffers)
        ]
        self.holds: list[int | None] = [None] * len(self.slots)
        self._views: dict[tuple[int, int], list] = {}
        self._last = len(self.slots) - 1  # the slot the latest block ran from
        self._running: int | None = None  # the slot of the block now running
        self.copies = 0
        self.bytes_copied = 0
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.ready = [torch.cuda.Event() for _ in self.slots]
            self.free = [torch.cuda.Event() for _ in self.slots]
            self.host = {i: self._pack_pinned(i) for i in self.order}
        else:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trickles-prefetch")
            self.pending: list[Future | None] = [None] * len(self.slots)
        self.handles = []
        for i in self.order:
            self.handles.append(blocks[i].register_forward_pre_hook(self._pre_hook(i)))
            self.handles.append(blocks[i].register_forward_hook(self._post_hook(i)))

    # ---- copying --------------------------------------------------------------------------
    def _pack_pinned(self, i: int) -> torch.Tensor:
        layout = self.layouts[i]
        flat = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=True)
        for (_, _, key, *_, fused), view in zip(layout.entries, layout.views(flat)):
            self.tensors.copy_into(key, view, fused)
        return flat

    def _copy_block(self, i: int, slot: int) -> None:
        """CPU: block ``i`` into buffer ``slot``, on the copy thread."""
        layout = self.layouts[i]
        for (_, _, key, *_, fused), view in zip(layout.entries, layout.views(self.slots[slot])):
            self.tensors.copy_into(key, view, fused, _copy_one_thread)

    def _fetch(self, i: int, slot: int) -> None:
        """Starts copying block ``i`` into buffer ``slot``."""
        self.holds[slot] = i
        self.copies += 1
        self.bytes_copied += self.layouts[i].nbytes
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.free[slot])  # the block that used this buffer has finished
                n = self.layouts[i].nbytes
                self.slots[slot][:n].copy_(self.host[i], non_blocking=True)
                self.ready[slot].record(self.copy_stream)
        else:
            self.pending[slot] = self._pool.submit(self._copy_block, i, slot)

    def _wait(self, slot: int) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
            return
        fut = self.pending[slot]
        if fut is not None:
            fut.result()
            self.pending[slot] = None

    # ---- hooks ----------------------------------------------------------------------------
    def _pre_hook(self, i: int):
        def hook(module, args):
            slot = self.holds.index(i) if i in self.holds else None
            if slot is None:
                slot = (self._last + 1) % len(self.slots)
                self._fetch(i, slot)
            self._wait(slot)
            views = self._views.get((i, slot))
            if views is None:
                views = self._views[(i, slot)] = [
                    nn.Parameter(v, requires_grad=False) if isinstance(m, nn.Parameter) else v
                    for (_, _, m), v in zip(self.meta[i], self.layouts[i].views(self.slots[slot]))
                ]
            for (mod, attr, _), v in zip(self.meta[i], views):
                _slot_of(mod, attr)[attr] = v
            self._last = self._running = slot
            if len(self.slots) == 2:
                nxt = self.order[(self.order.index(i) + 1) % len(self.order)]
                if nxt not in self.holds:
                    self._fetch(nxt, 1 - slot)

        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            for mod, attr, meta in self.meta[i]:
                _slot_of(mod, attr)[attr] = meta
            if self.cuda and self._running is not None:
                self.free[self._running].record(torch.cuda.current_stream(self.device))
            self._running = None

        return hook

    def close(self) -> None:
        """Removes the hooks and stops the copy thread (the streamed blocks are left without weights)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if not self.cuda:
            self._pool.shutdown(wait=True)


def kv_cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the KV cache of ``batch`` sequences of ``max_len`` positions: ``2 L B H_kv T D`` elements (latent
    attention: ``L B T (kv_lora_rank + qk_rope_head_dim)``, :class:`~trickles.models.latent_cache.LatentCache`)."""
    if cfg.attention == "mla":
        return cfg.n_layers * batch * max_len * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype.itemsize
    return 2 * cfg.n_layers * batch * cfg.kv_heads * max_len * cfg.head_dim * dtype.itemsize


def block_bytes(block: nn.Module) -> int:
    """Bytes a block takes in a streaming buffer: its parameters and persistent buffers, each starting at a multiple of
    :data:`ALIGN`."""
    return _Layout(block, "").nbytes


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def plan_for(model: Transformer, budget_bytes: int, batch: int, max_len: int) -> Placement:
    """The placement of ``model`` (on any device, meta included) for a KV cache of ``batch x max_len``."""
    blocks = list(model.layers.values())
    in_blocks = {id(t) for b in blocks for t in [*b.parameters(), *b.buffers()]}
    fixed = _nbytes([t for t in [*model.parameters(), *model.buffers()] if id(t) not in in_blocks])
    dtype = next(model.parameters()).dtype
    fixed += kv_cache_bytes(model.cfg, batch, max_len, dtype)
    return plan_placement([block_bytes(b) for b in blocks], fixed, budget_bytes)


@torch.no_grad()
def _materialize(module: nn.Module, prefix: str, tensors: CheckpointTensors, device) -> None:
    layouts = {name: fused_layout(p) for name, p in _state(module)}  # to_empty makes new parameters, untagged
    module.to_empty(device=device, recurse=True)
    for name, p in _state(module):
        tensors.copy_into(checkpoint_key(prefix + name), p, layouts[name])


def load_streaming(
    path: str,
    device: torch.device | str,
    budget_bytes: int,
    batch: int = 1,
    max_len: int | None = None,
    verify: bool = True,
    int8: str | None = None,
):
    """``(model, tokenizer, trainer_meta)`` like :func:`~trickles.train.load.load_for_inference`, within
    ``budget_bytes``.

    The budget covers the weights on ``device`` and a KV cache for ``batch`` sequences of
    ``max_len`` positions (default: the model's ``max_seq_len``). Blocks that do not fit stream
    (module docstring); ``model.placement`` says which, ``model.streamer`` is the
    :class:`BlockStreamer` (None when everything fits). Raises :class:`~trickles.errors.UserError`
    when even streaming every block does not fit. A quantized checkpoint (:mod:`trickles.compress`) streams its int8
    codes and scales (a quarter of fp32's bytes to move); ``int8`` picks its matmul (``weight``, the default, or
    ``full``).
    """
    device = torch.device(device)
    path = ckpt.resolve(path)
    if verify:
        ckpt.verify(path)
    meta = ckpt.read_json(os.path.join(path, "trainer.json"))
    # projections fused or apart as the resident model has them (module docstring): a quantized model keeps them apart
    apart = {"fused_proj": False} if meta.get("quantization") else {}
    with torch.device("meta"):
        model = Transformer(ModelConfig(**{**meta["model"], **apart}))
        if meta.get("quantization"):
            from ..compress.quantize import empty_quantized

            empty_quantized(model, int8 or "weight")
        elif int8 is not None:
            raise UserError(
                f"{path} is not quantized, so --int8 does not apply; quantize it with trickles compress quantize"
            )
    model.eval()
    tensors = CheckpointTensors(path)
    ckpt.check_fits(tensors.reader, {checkpoint_key(k): v for k, v in ckpt.unique_state(model).items()}, path)
    placement = plan_for(model, budget_bytes, batch, min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len))
    for name, child in model.named_children():
        if name != "layers" and not (name == "output" and model.cfg.tied):
            _materialize(child, name + ".", tensors, device)
    if model.cfg.tied:  # the output projection is the token embedding, stored once under its name
        model.output.weight = model.embed.weight
    for name, buf in list(model.named_buffers(recurse=False)):
        model._buffers[name] = torch.empty_like(buf, device=device)
    model.reset_buffers()
    for i in placement.resident:
        _materialize(model.layers[str(i)], f"layers.{i}.", tensors, device)
    streamed = {i: model.layers[str(i)] for i in placement.streamed}
    model.placement = placement
    model.streamer = BlockStreamer(streamed, placement, tensors, device) if streamed else None
    return model, load_tokenizer(os.path.join(path, "tokenizer")), meta


def prompt_length(path: str, prompts: list[str]) -> int:
    """Tokens of the longest of ``prompts`` under the tokenizer of the checkpoint at ``path`` (the left-padded batch's
    length; at least one: an empty prompt is eos)."""
    tokenizer = load_tokenizer(os.path.join(ckpt.resolve(path), "tokenizer"))
    return max(len(tokenizer.encode(p)) or 1 for p in prompts)


def save_for_inference(model: Transformer, tokenizer, path: str) -> str:
    """Writes ``model`` (whole, one process) and ``tokenizer`` as a checkpoint directory that
    :func:`load_streaming` and :func:`~trickles.train.load.load_for_inference` read; returns ``path``.

    Only what inference needs: ``model-rank00000.safetensors``, ``trainer.json`` with the model
    config, ``tokenizer/`` and the manifest (no optimizer state).
    """
    import dataclasses

    os.makedirs(path, exist_ok=True)
    ckpt.save_pieces(ckpt.model_pieces(model), os.path.join(path, "model-rank00000.safetensors"))
    ckpt.write_json(os.path.join(path, "trainer.json"), {"model": dataclasses.asdict(model.cfg)})
    tokenizer.save(os.path.join(path, "tokenizer"))
    ckpt.write_manifest(path)
    return path
