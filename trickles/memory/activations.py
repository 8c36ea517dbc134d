"""Activation memory: what autograd keeps for backward, predicted by formula and measured.

**Measured** (:class:`ActivationMeter`): a ``saved_tensors_hooks`` pack hook sees every tensor
autograd saves; distinct storages are counted once, parameters and buffers (model state, not
activations) are left out, and each tensor is charged to the transformer layer running when it
was first saved (``"head"``: embedding, final norm, output projection and loss). Under full
recomputation the checkpoint keeps a block's input through a function that saves it, so it is
seen the same way.

**Predicted** (:func:`activation_bytes`) for this implementation, per layer, with ``s`` tokens
per micro-batch (batch x sequence ``T``), hidden ``d``, query heads ``a`` and key/value heads
``a_kv`` of size ``h``, MLP width ``f``, ``p`` bytes per element of the compute type (fused
attention, dropout 0):

=================  ==========================================================  ===========================
piece              saved for backward                                          bytes
=================  ==========================================================  ===========================
RMSNorm (llama)    fp32 input, fp32 1/rms, x_hat, the output the next linear   ``4sd + 4s + 2psd``
                   keeps
LayerNorm (gpt2)   input, mean and 1/std, output (CPU autocast keeps p; CUDA   ``2psd + 2ps``
                   autocast upcasts: ``4sd + 8s + psd``)
attention          q, k, v after rotation; the fused kernel's output (which    ``ps(ah + 2 a_kv h) + psah
                   ``o_proj`` keeps as its input) and fp32 log-sum-exp;          + 4sa (+ 4Thp)``
                   llama in low precision: cos/sin cast for q and k
MLP                llama: gate, silu(gate), up, product; gpt2: pre-activation  ``4psf`` / ``2psf``
                   and GELU output
=================  ==========================================================  ===========================

With context parallelism (``cp`` ranks) every term counts this rank's ``s = batch x T / cp`` tokens
(``T`` in the cos/sin term becomes ``T / cp``); ring attention saves what the fused kernel saves
(its output laid out so ``o_proj`` keeps a view of it); the all-to-all mode's core keeps the fused
output in head shards beside ``o_proj``'s input in sequence shards, ``psah``, and the key/value
heads repeated ``f`` times (``2 (f-1) ps a_kv h``, see :func:`trickles.parallel.context.kv_repeats`),
both dropped by selective recomputation. llama in fp32 also keeps the rotary tables
gathered at the rank's positions, ``8 (T/cp) h`` once per forward (``"tables"``; the meter charges
them to the first layer that uses them).

A layer holds two norms, the attention and the MLP. ``selective`` recomputation of the
attention core drops what the core keeps beyond its inputs -- with a fused kernel only the
log-sum-exp, ``4sa`` (a non-fused core would also drop the ``a T^2`` probabilities);
``full`` keeps only the block input, ``psd``. The head keeps token ids and targets (``16s``),
position ids (gpt2), the final norm, and the fp32 log-softmax of the logits, ``4sV``, with the
loss's fp32 total weight (one scalar, ``4``) beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.config import ModelConfig


def activation_bytes(cfg: ModelConfig, batch: int, seq: int, recompute: str = "none", dtype_bytes: int = 4,
                     device_type: str = "cpu", tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                     cp_mode: str = "ring") -> dict[str, int]:
    """``{"layer": bytes per layer, "layers": all layers, "head": bytes, "tables": bytes, "total": ...}`` for one
    micro-batch of ``seq``-token sequences on one rank (``cp > 1``: its ``seq / cp`` tokens of each).

    With tensor parallelism ``tp > 1`` the heads and the MLP width are split (``a/tp``, ``f/tp``;
    key/value heads ``a_kv/tp``, or ``a/tp`` selected ones when they are replicated) while the
    norms see all ``s`` tokens; with ``sequence_parallel`` the norms work on ``s/tp`` tokens and
    the linears after them keep only that shard (Megatron-LM: every part outside the matmuls
    shrinks by ``tp``). Replicated key/value heads select theirs with an int64 index of ``a/tp``
    entries, kept for backward by k and by v (``16 a/tp`` bytes). The vocabulary-parallel loss
    keeps fp32 probabilities over ``V/tp``.
    """
    seq //= cp
    s = batch * seq
    t = tp
    d, a, kv, h, f, p = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_dim, dtype_bytes
    if t > 1:
        a, f, kv = a // t, f // t, (kv // t if kv % t == 0 else a // t)
    ulysses = cp > 1 and cp_mode == "ulysses"
    llama = cfg.flavor == "llama"
    sn = s // t if sequence_parallel and t > 1 else s  # tokens a norm works on
    if llama:
        norm = 4 * sn * d + 4 * sn + 2 * p * sn * d
    elif device_type == "cuda" and p != 4:
        norm = 4 * sn * d + 8 * sn + p * sn * d
    else:
        norm = 2 * p * sn * d + 2 * p * sn
    lse = 4 * s * a
    attention = p * s * (a * h + 2 * kv * h) + p * s * a * h + lse + (4 * seq * h * p if llama and p != 4 else 0)
    if t > 1 and cfg.kv_heads % t:  # replicated key/value heads: k and v each keep the int64 index of the heads they select
        attention += 2 * 8 * a
    mlp = (4 if llama else 2) * p * s * f
    core_extra = 0  # all-to-all: the fused output in head shards beside o_proj's input, the repeated heads
    if ulysses:
        from ..parallel.context import kv_repeats
        core_extra = p * s * a * h + (kv_repeats(a, kv, cp) - 1) * 2 * p * s * kv * h
    attention += core_extra
    full = p * sn * d  # the block input, on this rank's sequence shard under sequence parallelism
    layer = {"none": 2 * norm + attention + mlp, "selective": 2 * norm + attention + mlp - lse - core_extra,
             "full": full}.get(recompute)
    if layer is None:
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    vocab = cfg.vocab_size or 0
    if t > 1:  # embedding: shifted ids and the out-of-range mask; loss: ids and mask too
        head = 18 * s + norm + 4 * s * (vocab // t)
    else:  # ... and F.cross_entropy's fp32 total weight, a scalar
        head = 16 * s + norm + 4 * s * vocab + 4
    head += 0 if llama else 8 * seq
    layers = layer * cfg.n_layers
    tables = 8 * seq * h if cp > 1 and llama and p == 4 and recompute != "full" else 0
    return {"layer": layer, "layers": layers, "head": head, "tables": tables, "total": layers + head + tables}


class ActivationMeter:
    """Counts the bytes autograd saves during forward, per transformer layer (see module docstring).

    ``with ActivationMeter(model) as meter: loss = ...`` then ``meter.per_layer`` (``{name: bytes}``)
    and ``meter.total``. ``exclude`` returns storages that are model state (e.g. parameters
    gathered by ZeRO-3) beyond the module's own parameters and buffers.
    """

    def __init__(self, model: nn.Module, exclude=None):
        self.model = model
        self.exclude = exclude
        self.per_layer: dict[str, int] = {}
        self._seen: set[int] = set()
        self._current = "head"
        self._handles = []
        self._state: set[int] = set()

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in self._seen and ptr not in self._state and st.nbytes():
            if self.exclude is None or ptr not in self.exclude():
                self._seen.add(ptr)
                self.per_layer[self._current] = self.per_layer.get(self._current, 0) + st.nbytes()
        return t

    def _enter_layer(self, name):
        def hook(module, args):
            self._current = name
        return hook

    def _leave_layer(self, module, args, output):
        self._current = "head"

    def __enter__(self) -> "ActivationMeter":
        self._state = {t.untyped_storage().data_ptr() for t in [*self.model.parameters(), *self.model.buffers()] if not t.is_meta}
        layers = getattr(self.model, "layers", {})
        for name, block in layers.items():
            self._handles.append(block.register_forward_pre_hook(self._enter_layer(f"layers.{name}")))
            self._handles.append(block.register_forward_hook(self._leave_layer))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())

    @property
    def layers(self) -> dict[str, int]:
        return {k: v for k, v in self.per_layer.items() if k != "head"}
