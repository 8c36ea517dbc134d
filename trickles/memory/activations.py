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
attention; dropout below):

=================  ==========================================================  ===========================
piece              saved for backward                                          bytes
=================  ==========================================================  ===========================
RMSNorm (llama)    input, fp32 1/rms, the output the next linear keeps         ``2psd + 4s``
                   (``n`` recomputed in backward, :mod:`trickles.kernels.norms`)
LayerNorm (gpt2)   input, mean and 1/std, output (CPU autocast keeps p; CUDA   ``2psd + 2ps``
                   autocast upcasts: ``4sd + 8s + psd``)
attention          q, k, v after rotation; the fused kernel's output (which    ``ps(ah + 2 a_kv h) + psah
                   ``o_proj`` keeps as its input) and fp32 log-sum-exp;          + 4sa (+ 4Thp)``
                   llama in low precision: cos/sin cast for q and k
MLP                llama: gate, up, product (silu recomputed in backward);     ``3psf`` / ``2psf``
                   gpt2: pre-activation and GELU output
=================  ==========================================================  ===========================

**Dropout** (``model.dropout > 0``, training) adds, with ``q`` the bytes of one dropout mask element -- on a CPU
``p`` (``torch.dropout`` multiplies its input by a scaled keep-mask of the input's type, which the product keeps),
on CUDA 1 (the fused ``native_dropout`` keeps a bool mask):

=================  ==========================================================  ===========================
piece              saved for backward                                          bytes
=================  ==========================================================  ===========================
residual dropouts  the masks after ``o_proj`` and after the MLP (an MoE block's  ``2 q s_n d`` (``+ q s_n d``
                   output; its shared expert's MLP one more), on the tokens the  with shared experts)
                   norms see (``s_n = s/tp`` under sequence parallelism)
embedding          the mask of the embedding's dropout (head; a pipeline's        ``q s_n d``
                   first stage)
attention, CPU     SDPA's math path replaces the fused kernel (whose CPU kernel    ``12 s a h + 12 B a T^2``
                   takes no dropout): fp32 copies of q and k (scaled), v (k, v     in place of ``ps(ah + 2
                   repeated to the ``a`` query heads), the fp32 probabilities,     a_kv h) + 4sa``
                   their keep-mask and the dropped probabilities (``B`` the
                   micro-batch's sequences); fp32 and bf16 alike (the math path
                   upcasts low precision)
attention, CUDA    the fused kernels run dropout from a saved seed: what they      unchanged
                   keep without it
=================  ==========================================================  ===========================

``selective`` recomputation drops the attention core's own tensors as without dropout (the math path's
included: the checkpoint keeps q, k, v); ``full`` keeps the block input only. Context parallelism refuses
dropout. The CPU terms are measured to the byte (the tests); the CUDA ones follow the kernels' autograd formulas
(not measured here: no GPU). Korthikanti et al.'s formulas set beside these: :mod:`~trickles.memory.korthikanti`.

With context parallelism (``cp`` ranks) every term counts this rank's ``s = batch x T / cp`` tokens
(``T`` in the cos/sin term becomes ``T / cp``); ring attention saves what the fused kernel saves
(its output laid out so ``o_proj`` keeps a view of it); the all-to-all mode's core keeps the fused
output in head shards beside ``o_proj``'s input in sequence shards, ``psah``, and the key/value
heads repeated ``f`` times (``2 (f-1) ps a_kv h``, see :func:`trickles.parallel.context.kv_repeats`),
both dropped by selective recomputation. llama in fp32 also keeps the rotary tables
gathered at the rank's positions, ``8 (T/cp) h`` once per forward (``"tables"``; the meter charges
them to the first layer that uses them).

**Packed documents** (``data.document_mask``, :mod:`trickles.models.documents`; the CPU's dense path, measured to
the byte; CUDA's flex attention is not modelled) add, with ``T`` the whole sequence and ``s`` this rank's tokens:
the boolean mask converted to the compute type in each layer's attention core, ``p B T^2``, and k and v repeated
to the query heads (SDPA keeps those in place of the ``a_kv`` heads), ``2 p B T (a - f a_kv) h / cp`` (``f`` as
below; 1 without cp) -- on one process and in the all-to-all mode, whose core attends over whole sequences;
both dropped by selective recomputation; the ring keeps no more (its block masks are not saved tensors). Per
row positions replace shared ones: gpt2's position ids ``8s`` (for ``8T``), llama's rotary tables gathered per
row once, ``8sh`` in fp32 (not under full recomputation), and in low precision their casts ``4psh`` per layer
(for ``4Thp``).

**Per layer**, beside the formula above (``"layer"``: a dense layer over all earlier keys), a sliding window's mask and
the explicit path of soft-capped scores, :mod:`trickles.memory.attention_cores` (in ``"per_layer"``).

**Mixture-of-experts blocks** keep, in place of the MLP, what :mod:`trickles.memory.moe_activations` counts
(router, routing, experts, combine, auxiliary losses, shared experts; with expert parallelism the dispatch's rows).
Recomputation treats an MoE block like a dense one (``selective``: the attention core; ``full``: the block input,
and with hard routing the first block also keeps the per-token label ids, ``8s``, counted with ``"tables"``).

**Norm placement and q/k norms.** A post norm (``model.norm_placement`` post, sandwich) keeps its input and fp32
``1/rms``, ``p s_n d + 4 s_n`` (its output goes to the residual add, which keeps nothing); without pre norms (post)
the branches' linears keep the residual stream itself, ``p s_n d`` each. A q/k norm (``model.qk_norm``) keeps its
input and fp32 ``1/rms``: per head ``p s (a + a_kv) h + 4 s (a + a_kv)``, full width ``p s (a + a_kv) h + 8 s``;
split over ``tp > 1`` (its sum of squares all-reduced) the input in fp32 and the normalized product,
``(4 + p) s (a + a_kv) h + 8 s``. Both count with attention: selective keeps them, full drops them.

A layer holds two norms, the attention and the MLP. ``elementwise`` recomputation (:mod:`trickles.memory.recompute`)
drops each pre norm's output, ``p s_n d`` (gpt2's on CUDA in low precision excepted: its linears keep autocast's cast of
the fp32 output), and the activation's product, ``psf``. ``selective`` recomputation of the
attention core drops what the core keeps beyond its inputs -- with a fused kernel only the
log-sum-exp, ``4sa`` (a non-fused core would also drop the ``a T^2`` probabilities);
``full`` keeps only the block input, ``psd``. The head keeps token ids and targets (``16s``),
position ids (gpt2), the final norm, and the fp32 log-softmax of the logits, ``4sV``, with the
loss's fp32 total weight (one scalar, ``4``) and on one rank the int64 count of kept targets it is divided by
(``8``) beside it; soft-capped logits (``model.final_softcap``) their ``tanh``, ``psV`` (a scaled embedding,
``model.embed_scale``, keeps nothing more: its scale is a number).

**Fused loss** (``model.fused_loss``, :mod:`trickles.kernels.cross_entropy`): the head keeps, in place
of the targets and the log-softmax, the input and weight gradients computed in forward: ``p' s d + 4 V d``
(``p' = 4`` under fp16, else ``p``; with tensor parallelism ``s`` all tokens and ``V/tp``), and nothing
keeps the final norm's output (``- psd``, ``s/tp`` tokens under sequence parallelism). The
transient is one chunk's logits, :func:`loss_transient_bytes`, where unfused it is the loss's
backward (``8 sV``; ``4 sV/tp`` vocabulary-parallel).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.config import ModelConfig
from ..parallel.context import kv_repeats
from .attention_cores import core_bytes
from .latent_activations import latent_attention_bytes
from .moe_activations import moe_bytes
from .mtp_activations import mtp_bytes


def activation_bytes(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    recompute: str = "none",
    dtype_bytes: int = 4,
    device_type: str = "cpu",
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_mode: str = "ring",
    ep: int = 1,
    fused_loss: bool = False,
    fp16: bool = False,
    documents: bool = False,
    expert_load: str = "balanced",
) -> dict:
    """``{"layer": bytes per dense layer, "moe_layer": per mixture-of-experts layer (0 without experts),
    "per_layer": [what the meter charges each layer, :mod:`~trickles.memory.attention_cores`' terms included],
    "layers": all layers (tables apart), "head": bytes, "embedding": the part of the head the embedding keeps (a
    pipeline's first stage; the rest is the last's), "loss": the part the loss's own nodes keep (unfused: what a
    zero-bubble B frees on the last stage), "terms": a dense layer (``"layer"``, no attention-core terms) by piece --
    norms, attention, MLP (each with the norm output its linears keep), dropout masks,
    "tables": what the first layer keeps once for all (the rotary tables, hard routing's labels), "total": ...,
    "rebuilt": the largest output elementwise recomputation rebuilds in a backward, alive while a linear uses it}``
    for one micro-batch of ``seq``-token sequences on one rank (``cp > 1``: its ``seq / cp`` tokens of each).

    With tensor parallelism ``tp > 1`` the heads and the MLP width are split (``a/tp``, ``f/tp``;
    key/value heads ``a_kv/tp``, or ``a/tp`` selected ones when they are replicated) while the
    norms see all ``s`` tokens; with ``sequence_parallel`` the norms work on ``s/tp`` tokens and
    the linears after them keep only that shard (Megatron-LM: every part outside the matmuls
    shrinks by ``tp``). Replicated key/value heads select theirs with an int64 index of ``a/tp``
    entries, kept for backward by k and by v (``16 a/tp`` bytes). The vocabulary-parallel loss
    keeps fp32 probabilities over ``V/tp``.

    A mixture-of-experts block (module docstring) routes the tokens its norm sees (all ``s`` under tensor
    parallelism, ``s/tp`` with sequence parallelism) and keeps ``moe_bytes`` in place of the MLP's; ``ep > 1``
    adds the expert-parallel dispatch's terms for a balanced load. ``fused_loss``: the head of the chunked
    loss (module docstring); ``fp16``: the compute type is fp16 (the fused loss then keeps its input gradient in fp32);
    ``documents``: packed documents' masks (``data.document_mask``, module docstring).
    """
    whole_seq = seq
    seq //= cp
    s = batch * seq
    t = tp
    d, a, h, f, p, r = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.ffn_dim, dtype_bytes, cfg.rope_dim
    kv = a if cfg.attention == "mla" else cfg.kv_heads  # (latent attention: every head its own keys and values)
    if t > 1:
        a, f, kv = a // t, f // t, (kv // t if kv % t == 0 else a // t)
    ulysses = cp > 1 and cp_mode == "ulysses"
    llama = cfg.flavor == "llama"
    sn = s // t if sequence_parallel and t > 1 else s  # tokens a norm works on
    if llama:
        norm = 2 * p * sn * d + 4 * sn
    elif device_type == "cuda" and p != 4:
        norm = 4 * sn * d + 8 * sn + p * sn * d
    else:
        norm = 2 * p * sn * d + 2 * p * sn
    pre, post = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("post", "sandwich")
    # the branches' linears keep the norm's output (pre) or the residual stream itself; a post norm keeps its input
    norms = (2 * norm if pre else 2 * p * sn * d) + (2 * (norm - p * sn * d) if post else 0)
    drop = cfg.dropout > 0
    mask = (1 if device_type == "cuda" else p) if drop else 0  # bytes per element one dropout keeps (module docstring)
    qkv = p * s * (a * h + 2 * kv * h)
    if drop and device_type != "cuda":  # SDPA's math path: fp32 q, k, v (k, v repeated to a heads), scores' three
        lse = 4 * 3 * s * a * h + 12 * batch * a * seq * seq - qkv  # copies; in place of what the fused kernel keeps
    else:
        lse = 4 * s * a
    cast_tokens = s if documents else seq  # low-precision llama: rotary tables cast for q and k (per row: documents)
    attention = qkv + p * s * a * h + lse + (4 * cast_tokens * r * p if llama and p != 4 else 0)
    if cfg.qk_norm != "none":  # q's and k's norms: input, fp32 1/rms (per head or per token); tensor-parallel full
        split = cfg.qk_norm == "full" and t > 1  # width: its input in fp32 and the normalized product
        attention += (p + 4 * split) * s * (a + kv) * h + 4 * s * (a + kv if cfg.qk_norm == "head" else 2)
    if t > 1 and cfg.kv_heads % t:  # replicated key/value heads: k and v each keep the int64 index of theirs
        attention += 2 * 8 * a
    mlp = (3 if llama else 2) * p * s * f
    core_extra = 0  # all-to-all: the fused output in head shards beside o_proj's input, the repeated heads
    if ulysses:
        core_extra = p * s * a * h + (kv_repeats(a, kv, cp) - 1) * 2 * p * s * kv * h
    if documents and (cp == 1 or ulysses):  # the dense path on whole sequences: the mask in the compute type, and
        f_kv = kv_repeats(a, kv, cp) if ulysses else 1  # SDPA keeps k, v repeated to the query heads in place of theirs
        core_extra += p * batch * whole_seq * whole_seq + 2 * p * batch * whole_seq * (a - f_kv * kv) // cp * h
    attention += core_extra
    if cfg.attention == "mla":  # latent attention's terms in place of these (trickles.memory.latent_activations)
        attention, lse, core_extra = latent_attention_bytes(cfg, batch, seq, p, t, cp, cp_mode, documents, device_type)
    full = p * sn * d  # the block input, on this rank's sequence shard under sequence parallelism
    if recompute not in ("none", "elementwise", "selective", "full"):
        raise ValueError(f"recompute must be none, elementwise, selective or full, got {recompute!r}")
    elementwise = recompute == "elementwise"
    if elementwise and cfg.moe_experts:
        raise ValueError(
            "elementwise recomputation covers dense blocks only (the configuration refuses experts with it)"
        )
    # elementwise: the linears after a norm keep a recipe in place of its output -- except gpt2's on CUDA in low
    # precision, whose linears keep autocast's cast of the fp32 output, not the output -- and the down projection
    # one in place of the activation's
    out_dropped = p * sn * d if elementwise and pre and not (not llama and device_type == "cuda" and p != 4) else 0
    act_dropped = p * s * f if elementwise else 0

    def block(ffn: int, drops: int = 2) -> int:  # ``drops``: the dropouts on the residual branches
        ffn += drops * mask * sn * d
        return {
            "none": norms + attention + ffn,
            "selective": norms + attention + ffn - lse - core_extra,
            "elementwise": norms + attention + ffn - 2 * out_dropped - act_dropped,
            "full": full,
        }[recompute]

    layer = block(mlp)
    recomputed = {"none": 0, "elementwise": 0, "selective": lse + core_extra, "full": None}[recompute]
    kept = p * sn * d - out_dropped  # each norm's output, as its linears keep it
    # a dense layer by piece (each norm's output counted with the linears that keep it): sums to ``layer``
    terms = (
        {"block input": full}
        if recomputed is None
        else {
            "norms": norms - 2 * p * sn * d,
            "attention": kept + attention - recomputed,
            "mlp": kept + mlp - act_dropped,
            "dropout masks": 2 * mask * sn * d,
        }
    )
    load = {"device_type": device_type, "expert_load": expert_load}
    experts = moe_bytes(cfg, batch, sn // batch, whole_seq, p, ep, **load) if cfg.moe_experts else 0
    moe_layer = block(experts, 3 if cfg.moe_shared_experts else 2) if cfg.moe_experts else 0
    vocab = _vocab(cfg)
    if fused_loss:  # ids (tp: shifted ids and mask), the final norm (no linear keeps its output), the input
        # gradient over all tokens, the fp32 weight gradient
        head = (9 if t > 1 else 8) * s + norm - p * sn * d + (4 if fp16 else p) * s * d + 4 * (vocab // t) * d
        loss = 0  # (its own function computes the output projection's gradients)
    else:  # the loss's own: its ids (tp: and mask), the fp32 log-softmax (tp: probabilities), the target count
        loss = (9 if t > 1 else 8) * s + 4 * s * (vocab // t) + 4  # (or F.cross_entropy's fp32 total weight,
        loss += 8 if t == 1 else 0  # and on one rank the int64 count of kept targets its sum is divided by)
        loss += p * s * (vocab // t) if cfg.final_softcap is not None else 0  # the capped logits' tanh
        head = (9 if t > 1 else 8) * s + norm + loss  # the embedding's ids (tp: shifted, and the out-of-range mask)
    positions = 8 * (s if documents else seq)  # gpt2's position ids (with documents, each row's)
    embedding = (9 if t > 1 else 8) * s + (0 if llama else positions) + mask * sn * d  # ids, gpt2's positions, dropout
    head += embedding - (9 if t > 1 else 8) * s  # (the ids are counted above)
    moe = set(cfg.moe_layers)
    per_layer = [moe_layer if i in moe else layer for i in range(cfg.n_layers)]
    if (cp == 1 or ulysses) and not documents and recompute in ("none", "elementwise"):  # a window's, soft caps'
        core = (batch, whole_seq, a // cp, kv * kv_repeats(a, kv, cp) // cp, p, not ulysses)  # whole sequences
        per_layer = [b + core_bytes(cfg, i, *core) for i, b in enumerate(per_layer)]
    layers = sum(per_layer)
    tables = (
        8 * (s if documents else seq) * r if (cp > 1 or documents) and llama and p == 4 and recompute != "full" else 0
    )
    # full recomputation keeps each block's inputs, hard routing's per-token label ids among them (one storage)
    labels = 8 * s if recompute == "full" and cfg.moe_experts and cfg.moe_router == "hard" else 0
    if per_layer:
        per_layer[0] += tables + labels
    head += mtp_bytes(cfg, batch, seq, sn, p, t, norm, norms + attention, mlp, experts, mask, fused_loss, fp16)
    return {
        "layer": layer,
        "moe_layer": moe_layer,
        "per_layer": per_layer,
        "layers": layers,
        "head": head,
        "embedding": embedding,
        "tables": tables + labels,
        "total": layers + head + tables + labels,
        "terms": terms,
        "rebuilt": max(out_dropped, act_dropped),
        "loss": loss,
    }


def loss_transient_bytes(
    cfg: ModelConfig,
    tokens: int,
    dtype_bytes: int = 4,
    tp: int = 1,
    fused_loss: bool = False,
    triton: bool = False,
    fp32_mm: bool = False,
) -> int:
    """The loss's largest short-lived tensors for ``tokens`` tokens on one rank.

    Unfused: the fp32 gradients of the log-probabilities and of the logits, alive together in its backward
    (``8 sV``); vocabulary-parallel, the gradient is written into the saved probabilities, one more
    ``[s, V/tp]`` (``4 sV/tp``). Fused (:mod:`trickles.kernels.cross_entropy`), with ``c`` tokens per chunk
    and ``p`` the compute type's bytes: in fp32 the chunk's logits, turned into their gradient in place
    (``4 c V/tp``); in low precision the PyTorch path adds their fp32 copy and its cast back, and the
    chunk's input in fp32 for the weight gradient's product (``(2p + 4) c V/tp + 4 c d``); the Triton kernels
    work on the logits in their own type, the chunk's weight gradient in it before it joins the fp32 sum
    (``p c V/tp + p V d / tp``), or, where ``fp32_mm`` (a GPU whose matmul adds its low-precision product into
    fp32 as it makes it, :func:`~trickles.kernels.cross_entropy.fp32_accumulating_mm`), straight into the sum
    (``p c V/tp``). Soft-capped logits (``model.final_softcap``) add the chunk's ``tanh`` beside them, ``p c V/tp``
    (the PyTorch path in low precision: its fp32 copy, ``4 c V/tp``, as it turns the fp32 gradient into the raw
    logits').
    """
    from ..kernels.cross_entropy import default_chunk

    v = _vocab(cfg) // tp
    if not fused_loss:
        return (8 if tp == 1 else 4) * tokens * v
    p = dtype_bytes
    c = cfg.loss_chunk or default_chunk(tokens, _vocab(cfg), cfg.d_model)
    c = min(c, tokens)
    # capped logits: the chunk's tanh beside them (PyTorch in low precision: its fp32 copy for the fp32 gradient)
    capped = (4 if p != 4 and not triton else p) * c * v if cfg.final_softcap is not None else 0
    if p == 4:
        return capped + 4 * c * v
    if triton:
        return capped + p * c * v + (0 if fp32_mm else p * v * cfg.d_model)
    return capped + (2 * p + 4) * c * v + 4 * c * cfg.d_model


def _vocab(cfg: ModelConfig) -> int:
    if cfg.vocab_size is None:
        raise ValueError(
            "resolve model.vocab_size before predicting activations (trickles.models.config.resolve_model)"
        )
    return cfg.vocab_size


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
        # an alias without the autograd history: a saved output returned as itself would reference its own node
        # (node -> saved variable -> tensor -> node), a cycle the garbage collector cannot see, freed only when a
        # backward without retain_graph releases the node -- never, for nodes a split backward leaves behind
        return t.detach()

    def _enter_layer(self, name):
        def hook(module, args):
            self._current = name

        return hook

    def _leave_layer(self, module, args, output):
        self._current = "head"

    def __enter__(self) -> ActivationMeter:
        self._state = {
            t.untyped_storage().data_ptr() for t in [*self.model.parameters(), *self.model.buffers()] if not t.is_meta
        }
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
