"""A single-device decoder-only transformer in two flavours.

``llama``: RMSNorm, rotary position embeddings (rotate-half convention), SwiGLU MLP
``down(silu(gate(x)) * up(x))``, grouped-query attention, no biases, untied output by default.
``gpt2``: LayerNorm, learned absolute positions, GELU (tanh) MLP ``down(gelu(up(x)))``,
biases everywhere, output projection tied to the token embedding.

Both are pre-norm by default: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``; ``model.norm_placement`` moves
the norms onto the branches' outputs or puts them in both places (see :class:`Block`). Attention
(:mod:`trickles.models.attention`) runs through ``torch.nn.functional.scaled_dot_product_attention``
(causal), so the fused flash / memory-efficient kernels are used where the device has them.

This file knows nothing about parallelism. The parallel plans replace its linears and split its
layers from the outside; to make that possible, modules read head counts from their weights'
shapes at run time, and layers live in a ``ModuleDict`` keyed by their global index so a stage
that holds layers 4..7 still names them ``layers.4`` ... ``layers.7``.

Initialization is a pure function of (seed, parameter name, shape): see :func:`initial_value`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cross_entropy import OutputLoss, softcap
from ..kernels.norms import LayerNorm, RMSNorm
from ..kernels.rotary import apply_rope
from . import fused
from .attention import Attention
from .config import ModelConfig
from .documents import DocumentMask
from .kv_cache import KVCache
from .latent_cache import LatentCache
from .mla import LatentAttention
from .mlp import MLP
from .moe import MoE, MoEStats
from .mtp import MTPLayer, mtp_loss
from .rope import RopeScaling, rope_tables

__all__ = ["RMSNorm", "LayerNorm", "apply_rope", "Transformer", "build_model"]

#: the attention part of each ``model.attention``: multi-head (grouped-query) or multi-head latent attention
ATTENTION = {"mha": Attention, "mla": LatentAttention}


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.flavor == "llama":
        return RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels, cfg.norm_unit_offset)
    return LayerNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialized: :meth:`Transformer.init_weights` sets every parameter. (Its own
    ``normal_`` on the meta device, where models are built, would import TorchDynamo: about a second of every
    ``generate``, ``serve`` or ``export`` that never compiles; training imports it anyway, with ``torch.optim``.)"""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class Block(nn.Module):
    """Transformer block: ``h = x + attn_post_norm(attn(attn_norm(x))); y = h + mlp_post_norm(mlp(mlp_norm(h)))``;
    ``mlp`` is a :class:`~trickles.models.moe.MoE` in the mixture-of-experts blocks, ``attn`` the part
    ``model.attention`` names (:data:`ATTENTION`: grouped-query or latent attention).

    ``model.norm_placement`` picks which norms are real and which are ``nn.Identity``: ``pre`` the ``*_norm``
    before each branch (Llama, GPT-2), ``post`` the ``*_post_norm`` on each branch's output before the residual add
    (OLMo 2), ``sandwich`` all four (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, moe_stats: MoEStats | None = None):
        super().__init__()
        pre, post = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("post", "sandwich")
        self.attn_norm = make_norm(cfg) if pre else nn.Identity()
        self.attn = ATTENTION[cfg.attention](cfg, layer_id)
        self.attn_post_norm = make_norm(cfg) if post else nn.Identity()
        self.mlp_norm = make_norm(cfg) if pre else nn.Identity()
        self.mlp_post_norm = make_norm(cfg) if post else nn.Identity()
        self.moe = layer_id in cfg.moe_layers
        self.mlp = MoE(cfg, layer_id, moe_stats) if self.moe else MLP(cfg)

    def forward(
        self,
        x,
        rope=None,
        cache: KVCache | None = None,
        start: int = 0,
        labels: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
        documents: DocumentMask | None = None,
    ):
        """``labels``: the samples' label ids, for hard-routed experts (see :class:`~trickles.models.moe.MoE`);
        ``pad_mask``, ``documents``: see :meth:`~trickles.models.attention.Attention.core`."""
        extra = {} if documents is None else {"documents": documents}
        h = x + self.attn_post_norm(self.attn(self.attn_norm(x), rope, cache, start, pad_mask, **extra))
        return h + self.mlp_post_norm(self.mlp(self.mlp_norm(h), labels) if self.moe else self.mlp(self.mlp_norm(h)))


class Transformer(nn.Module):
    """Token ids ``[B, T]`` in, logits ``[B, T, vocab]`` out -- or, given targets, the mean token cross-entropy.

    The loss goes through :attr:`loss` (:class:`~trickles.kernels.cross_entropy.OutputLoss`), which with
    ``model.fused_loss`` computes it chunk by chunk from the hidden states and the output weight,
    never holding the logits.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None or cfg.max_seq_len is None:
            raise ValueError(
                "resolve model.vocab_size and model.max_seq_len before building (trickles.config.resolve_model)"
            )
        cfg.validate()
        self.cfg = cfg
        self.embed = _embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = _embedding(cfg.max_seq_len, cfg.d_model) if cfg.flavor == "gpt2" else None
        self.embed_drop = nn.Dropout(cfg.dropout)
        #: what the mixture-of-experts blocks report (auxiliary losses, load), None without experts
        self.moe_stats = MoEStats() if cfg.moe_experts else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, self.moe_stats) for i in range(cfg.n_layers)})
        #: the multi-token prediction modules (model.mtp_depth, :mod:`trickles.models.mtp`): trained, never inferred
        self.mtp = mtp_modules(cfg, self.moe_stats)
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.output.weight = self.embed.weight
        self.loss = OutputLoss(cfg.fused_loss, cfg.loss_chunk, cfg.kernels, cfg.final_softcap)
        if cfg.flavor == "llama":  # with a local rotary base: [global | local] side by side (Attention.rope_part)
            width = cfg.rope_dim * (1 if cfg.rope_local_theta is None else 2)
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, width), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, width), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self._rope_rows = 0  # rows of the rotary tables filled so far (ensure_rope)
        if not self.output.weight.is_meta:  # built for real (on the meta device: after to_empty, by init_weights)
            self.reset_buffers()
        fused.tag(self, cfg)

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        start: int = 0,
        labels: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        pad_mask: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``labels``: label ids per sample ``[B]`` or per token ``[B, T]``, used by hard-routed experts only.
        ``target``: next-token ids ``[B, T]`` (``-100``: ignored); given, the mean cross-entropy is returned (in
        training mode with ``model.mtp_depth``, plus the weighted multi-token prediction loss, :mod:`.mtp`).

        Left-padded batches (prompts of different lengths, :mod:`trickles.infer.decode`): ``positions [B, T]`` are
        each row's own token positions (``start..`` by default) and ``pad_mask [B, S]`` (True: a real token) covers
        the cache slots ``0..S`` so no query attends to padding; the slots themselves still run ``start..start+T``.
        A 4-D ``pad_mask [B, 1, T, S]`` is the attention mask itself (a paged cache's: :mod:`trickles.infer.paged`).

        Packed documents (``data.document_mask``): ``documents [B, T]`` are the tokens' document ids; attention stays
        within each document and positions restart at each (:mod:`trickles.models.documents`)."""
        extra = {} if pad_mask is None else {"pad_mask": pad_mask}
        if documents is not None:
            mask = extra["documents"] = self.document_mask(documents, tokens.device)
            positions = mask.positions
        h = self.embed_tokens(
            tokens, start, positions, documents.shape[1] if documents is not None else None, with_head=True
        )
        rope = self.rope(start, tokens.shape[1]) if positions is None else self.rope(start, tokens.shape[1], positions)
        for block in self.layers.values():
            h = block(h, rope, cache, start, labels, **extra)
        if self.mtp is None or target is None or not self.training:
            return self.head(h, target)
        return self.head(h, target) + mtp_loss(self, h, tokens, target, rope, positions, labels, documents, **extra)

    # The three parts of ``forward``, callable on their own (a pipeline stage runs some of them).
    def embed_tokens(
        self,
        tokens: torch.Tensor,
        start: int = 0,
        positions: torch.Tensor | None = None,
        bound: int | None = None,
        with_head: bool = False,
    ) -> torch.Tensor:
        """Token (and, for gpt2, position) embeddings of ``tokens [B, T]`` at positions ``start..`` (or each row's
        ``positions [B, T]``, below ``bound`` where the caller knows it: otherwise read, a host sync), after dropout.
        With ``model.embed_scale`` the token embeddings are multiplied by ``sqrt(d_model)`` rounded to their type.

        ``with_head``: the same backward also takes the tied output projection's gradient (:meth:`forward`), whose
        dense ``[vocab, d]`` tensor autograd sums with this lookup's before the table's gradient is stored, so the
        lookup's gradient is sparse (its rows only) instead of a zero-filled dense table: the stored gradient is
        dense either way. A caller without the head (a pipeline's first stage) gets the dense lookup."""
        t = tokens.shape[1]
        last = start + t if positions is None else (bound if bound is not None else int(positions.max()) + 1)
        if last > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {last} tokens is longer than model.max_seq_len={self.cfg.max_seq_len}")
        w = self.embed.weight
        if with_head and self.cfg.tied and type(self.embed) is nn.Embedding and w.requires_grad and w.is_leaf:
            h = F.embedding(tokens, w, sparse=torch.is_grad_enabled())
        else:
            h = self.embed(tokens)
        if self.cfg.embed_scale:
            h = h * float(torch.tensor(self.cfg.d_model**0.5, dtype=h.dtype))  # (a number: nothing saved)
        if self.pos_embed is not None:
            h = h + self.pos_embed(
                torch.arange(start, start + t, device=tokens.device) if positions is None else positions
            )
        return self.embed_drop(h)

    def rope(
        self, start: int, length: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables of positions ``start..start+length`` ``[T, D]``, or of each row's ``positions [B, T]``
        ``[B, T, D]`` (None for learned positions); ``D`` is ``2 head_dim`` with ``model.rope_local_theta`` (each
        layer reads its part, :attr:`~trickles.models.attention.Attention.rope_part`)."""
        if self.rope_cos is None:
            return None
        if positions is not None:  # rows named by a tensor (no host sync to read them): every row, filled once
            self.ensure_rope(self.cfg.max_seq_len)
            return self.rope_cos[positions], self.rope_sin[positions]
        self.ensure_rope(start + length)
        return self.rope_cos[start : start + length], self.rope_sin[start : start + length]

    def document_mask(self, documents: torch.Tensor, device: torch.device) -> DocumentMask:
        """The attention mask and positions of packed documents ``[B, T]`` (context parallelism swaps in its own)."""
        return DocumentMask(documents, device=device)

    def head(self, h: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and output projection: hidden states in, logits out (``model.final_softcap``: capped, ``cap *
        tanh(z / cap)``); with ``target``, the mean token cross-entropy of those logits."""
        h = self.norm(h)
        if target is None:
            return softcap(self.output(h), self.cfg.final_softcap)
        return self.loss(h, self.output, target)

    # ---- initialization -------------------------------------------------------------------
    def to_empty(self, *, device, recurse: bool = True) -> Transformer:
        """Allocates uninitialized storage on ``device``, keeping a tied output projection tied."""
        super().to_empty(device=device, recurse=recurse)
        self._rope_rows = 0  # the tables' new storage holds nothing yet
        if self.cfg.tied and self.output is not None and self.embed is not None:
            self.output.weight = self.embed.weight
        fused.tag(self, self.cfg)  # new Parameter objects
        return self

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Sets every parameter to :func:`initial_value` and recomputes the rotary tables.

        Works on a model built on the meta device after ``to_empty``.
        """
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.cfg, name, tuple(p.shape), seed))
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Marks the rotary tables for recomputation from the config: :meth:`ensure_rope` fills the rows a forward
        reads, when it first reads them."""
        self._rope_rows = 0
        for m in self.modules():  # the routing biases start at zero (a checkpoint's are loaded after)
            if isinstance(m, MoE):
                m.router.reset_bias()

    @torch.no_grad()
    def ensure_rope(self, rows: int) -> None:
        """Fills the rotary tables (:func:`~trickles.models.rope.rope_tables`, scaled by ``model.rope_type``; with
        ``model.rope_local_theta`` the sliding-window layers' unscaled tables beside them) up to position ``rows``.

        Lazily, because a model's tables span ``max_seq_len`` (131,072 positions for Llama 3.1), most of which a short
        run never reads, and computing them all was most of what importing a 1B model took. Each fill at least doubles
        the rows (4,096 at first), so a decode that grows fills O(log) times. The rows are written through ``.data``:
        a graph still holding views of rows already filled (gradient accumulation) must not see its buffer's version
        change."""
        if self.rope_cos is None or rows <= self._rope_rows:
            return
        c, start = self.cfg, self._rope_rows
        end = min(c.max_seq_len, max(rows, 2 * start, 4096))
        dev = self.rope_cos.device
        cos, sin = rope_tables(c.rope_dim, end, c.rope_theta, dev, RopeScaling.of(c), start=start)
        if c.rope_local_theta is not None:
            local = rope_tables(c.head_dim, end, c.rope_local_theta, dev, start=start)
            cos, sin = torch.cat([cos, local[0]], -1), torch.cat([sin, local[1]], -1)
        self.rope_cos.data[start:end].copy_(cos)
        self.rope_sin.data[start:end].copy_(sin)
        self._rope_rows = end

    def new_cache(self, batch: int, max_len: int, dtype=None) -> KVCache | LatentCache:
        """The decoding cache of ``batch`` rows of ``max_len`` positions (a latent one with ``model.attention=mla``)."""
        p = next(self.parameters())
        if self.cfg.attention == "mla":
            width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
            return LatentCache(self.cfg.n_layers, batch, max_len, width, dtype or p.dtype, p.device)
        # key/value heads this model holds (fewer than cfg.kv_heads when a parallel plan split them)
        attn = next(iter(self.layers.values())).attn
        if attn.fused:
            kv_heads = attn.qkv_proj.out_features // ((attn.rep + 2) * self.cfg.head_dim)
        else:
            kv_heads = attn.k_proj.out_features // self.cfg.head_dim
        return KVCache(self.cfg.n_layers, batch, kv_heads, max_len, self.cfg.head_dim, dtype or p.dtype, p.device)


def mtp_modules(cfg: ModelConfig, moe_stats: MoEStats | None) -> nn.ModuleDict | None:
    """The ``model.mtp_depth`` multi-token prediction modules (None without): depth ``k``'s block is block
    ``n_layers + k - 1`` of the model extended by ``mtp_depth`` blocks (its attention, window and experts by the
    model's own rules: the last block's window, DeepSeek-V3's experts)."""
    if not cfg.mtp_depth:
        return None
    windows = None if cfg.window_layers is None else [*cfg.window_layers, *cfg.window_layers[-1:] * cfg.mtp_depth]
    ext = dataclasses.replace(cfg, n_layers=cfg.n_layers + cfg.mtp_depth, window_layers=windows)
    return nn.ModuleDict(
        {
            str(k): MTPLayer(cfg.d_model, lambda: make_norm(cfg), Block(ext, cfg.n_layers + k, moe_stats))
            for k in range(cfg.mtp_depth)
        }
    )


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's name (stable across processes)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value of parameter ``name`` (fp32, CPU), independent of any layout.

    Norm weights are one (zero with ``model.norm_unit_offset``: they scale by ``1 + w``), biases zero, other weights
    ``N(0, init_std)``; the projections that
    write into the residual stream (``o_proj``, ``down_proj``) use ``init_std / sqrt(2 n_layers)``
    (GPT-2). A parallel plan that holds a slice of a parameter computes this and keeps its slice. A fused
    projection's value is its parts' values (each by its own name) fused, so it starts where an unfused
    model starts.
    """
    layout = fused.layout_of(cfg, name)
    if layout is not None:
        return layout.fuse(
            [
                initial_value(cfg, part, (layout.groups * n, *shape[1:]), seed)
                for part, n in zip(layout.part_keys(name), layout.sizes)
            ]
        )
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return torch.ones(shape) if leaf == "weight" and not cfg.norm_unit_offset else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std = std / math.sqrt(2 * cfg.n_layers)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=g)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Transformer:
    """Builds on the meta device, allocates on ``device`` and initializes from ``seed``."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def count_params(model: nn.Module, embeddings: bool = True) -> int:
    """Parameters (shared ones once); ``embeddings=False`` leaves out the token and position tables."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not embeddings and ("embed" in name) and "output" not in name:
            continue
        total += p.numel()
    return total
