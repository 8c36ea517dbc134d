"""Activation recomputation, applied to a built model from the outside.

* ``full``: each transformer block's forward runs under non-reentrant
  ``torch.utils.checkpoint``; only the block's input is kept for backward, and the whole block
  is recomputed from it when its gradients are needed (about one extra forward per step).
* ``selective``: only the attention core (scores, softmax, dropout, weighted sum and the
  re-layout of heads, ``Attention.core``) is recomputed. Its inputs ``q, k, v`` are kept
  anyway by the projections' backward, so what is saved is the core's own output and softmax
  statistics (with a non-fused attention: the ``T x T`` probabilities); redoing it is cheap
  next to the matmuls (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models").
* ``elementwise``: no matmul runs again. Each block's norms (before attention and MLP and, where
  ``model.norm_placement`` puts them, on their outputs) and its MLP activation keep, for their own
  backward, their inputs (a norm: ``x`` and the fp32 ``1/rms``; SwiGLU: the gate and up outputs; GELU: its
  input); their outputs are kept a second time by the linears that read them (for ``dW = dy^T x``). Under this
  mode those linears keep a *recipe* in their place -- the module and the inputs its own backward keeps anyway --
  and the output is recomputed from it when the linear's backward asks for it: ``p s d`` bytes fewer per norm
  (``s/tp`` tokens under sequence parallelism, where the column-parallel linears keep the sequence shard) and
  ``p s f`` fewer for the activation's product (``f/tp`` under tensor parallelism), for one pass over those
  elements per linear that reads them (Megatron-Core's ``recompute_modules`` ``layernorm`` and the activations'
  ``moe_act``, for dense MLPs here). Blocks of mixture-of-experts layers, the 2-D/2.5-D/3-D grids' norms and
  ``train.compile`` (whose partitioner chooses what to recompute) are refused by the configuration.

  How: a ``saved_tensors_hooks`` pair around each block's forward. A forward hook on each norm and on the
  activation marks its output (contiguous, alone in its storage); the pack hook swaps any saved tensor that lies
  in a marked output's storage (the output or a view of it, as ``F.linear`` saves a 2-D view of a 3-D input) for
  the recipe and that view's size, stride and offset, and hands every other tensor to the hooks outside (the
  memory meter's), if any. The unpack hook reruns the module's forward under ``no_grad`` with the autocast state
  of the forward and takes the same view of the result. A norm the placement leaves out (``nn.Identity``) is not
  marked: its output is its input, which a recipe would keep unseen. A post norm's output is read by the residual
  add, which saves nothing, so marking it saves nothing today; it is marked so that whatever keeps it is covered.

All of them give bit-identical losses and gradients: the recomputation repeats the same operations,
with the random state of dropout restored. Recomputation only happens when autograd records a
graph; evaluation and generation run the plain forward.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "elementwise", "selective", "full")


def _recomputed(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return run


def _outer_hooks():
    """The saved-tensor hooks already in force (a memory meter's), or None. ``saved_tensors_hooks`` pairs do not
    chain -- the innermost alone applies -- so a pair pushed inside another hands it what it does not keep itself."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Recipe:
    """How to rebuild a view of a marked output: rerun ``fn(*args)`` and take ``(size, stride, offset)`` of it."""

    __slots__ = ("fn", "args", "autocast", "view")

    def __init__(self, fn, args, autocast, view):
        self.fn, self.args, self.autocast, self.view = fn, args, autocast, view

    def rebuild(self) -> torch.Tensor:
        device, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            full = self.fn(*self.args)
        return full.as_strided(*self.view)


class _ElementwiseHooks:
    """One block's forward: the outputs marked so far, and the pack/unpack pair that replaces them by recipes."""

    def __init__(self):
        self.marked: dict[int, tuple] = {}  # storage address -> (module forward, its inputs, autocast state)
        self.outer = None

    def mark(self, module, args, out) -> None:
        if (
            not torch.is_grad_enabled()
            or not isinstance(out, torch.Tensor)
            or not out.is_contiguous()
            or out.storage_offset()
            or out.untyped_storage().nbytes() != out.numel() * out.element_size()
        ):
            return  # a recipe rebuilds a fresh contiguous tensor: only an output alone in its storage is its image
        dev, key = out.device.type, out.untyped_storage().data_ptr()
        self.marked[key] = (module.forward, args, (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        # forgotten when the output is: its address may then be another tensor's (a view made from it before then
        # keeps the storage, and so the address, alive)
        weakref.finalize(out, self.marked.pop, key, None)

    def pack(self, t: torch.Tensor):
        hit = self.marked.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if hit is not None:
            return _Recipe(*hit, (t.size(), t.stride(), t.storage_offset()))
        if self.outer is not None:
            return (self.outer[1], self.outer[0](t))
        return t.detach()  # an alias without history: a saved output returned as itself would reference its own node

    def unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, _Recipe):
            return packed.rebuild()
        if isinstance(packed, tuple):  # the outer hooks' unpack, and what their pack returned
            return packed[0](packed[1])
        return packed

    def run(self, fn, args, kwargs):
        self.outer, self.marked = _outer_hooks(), {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return fn(*args, **kwargs)
        finally:
            self.marked = {}  # the outputs themselves are not kept past the forward


def _elementwise(block) -> None:
    hooks = _ElementwiseHooks()
    for module in (block.attn_norm, block.attn_post_norm, block.mlp_norm, block.mlp_post_norm, block.mlp.act):
        if not isinstance(module, nn.Identity):  # an absent norm's output is its input: no recipe rebuilds that
            module.register_forward_hook(hooks.mark)
    forward = block.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return hooks.run(forward, args, kwargs)

    block.forward = run


def apply_recompute(model, mode: str | dict[int, str]) -> None:
    """Wraps ``model``'s blocks (full), attention cores (selective) or norms and activations (elementwise) for
    recomputation, in place: every block as ``mode``, or each layer as ``mode[layer]`` (a partial full
    recomputation, :meth:`~trickles.config.Config.recompute_modes`)."""
    modes = mode if isinstance(mode, dict) else {int(name): mode for name in model.layers}
    for m in set(modes.values()):
        if m not in MODES:
            raise ValueError(f"recompute mode must be one of {MODES}, got {m!r}")
    for name, block in model.layers.items():
        mode = modes[int(name)]
        if mode == "none":
            continue
        if mode == "elementwise":
            _elementwise(block)
        elif mode == "full":
            block.forward = _recomputed(block.forward)
        else:
            block.attn.core = _recomputed(block.attn.core)
