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

import hashlib
import math

import torch
from torch import nn

from ..kernels.cross_entropy import OutputLoss
from ..kernels.norms import LayerNorm, RMSNorm
from ..kernels.rotary import apply_rope
from . import fused
from .attention import Attention
from .config import ModelConfig
from .documents import DocumentMask
from .kv_cache import KVCache
from .mlp import MLP
from .moe import MoE, MoEStats
from .rope import RopeScaling, rope_tables

__all__ = ["RMSNorm", "LayerNorm", "apply_rope", "Transformer", "build_model"]


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.flavor == "llama":
        return RMSNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)
    return LayerNorm(cfg.d_model, cfg.norm_eps, cfg.kernels)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialized: :meth:`Transformer.init_weights` sets every parameter. (Its own
    ``normal_`` on the meta device, where models are built, would import TorchDynamo: about a second of every
    ``generate``, ``serve`` or ``export`` that never compiles; training imports it anyway, with ``torch.optim``.)"""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class Block(nn.Module):
    """Transformer block: ``h = x + attn_post_norm(attn(attn_norm(x))); y = h + mlp_post_norm(mlp(mlp_norm(h)))``;
    ``mlp`` is a :class:`~trickles.models.moe.MoE` in the mixture-of-experts blocks.

    ``model.norm_placement`` picks which norms are real and which are ``nn.Identity``: ``pre`` the ``*_norm``
    before each branch (Llama, GPT-2), ``post`` the ``*_post_norm`` on each branch's output before the residual add
    (OLMo 2), ``sandwich`` all four (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, moe_stats: MoEStats | None = None):
        super().__init__()
        pre, post = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("post", "sandwich")
        self.attn_norm = make_norm(cfg) if pre else nn.Identity()
        self.attn = Attention(cfg, layer_id)
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
        self.norm = make_norm(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.output.weight = self.embed.weight
        self.loss = OutputLoss(cfg.fused_loss, cfg.loss_chunk, cfg.kernels)
        if cfg.flavor == "llama":
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
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
        ``target``: next-token ids ``[B, T]`` (``-100``: ignored); given, the mean cross-entropy is returned.

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
        h = self.embed_tokens(tokens, start, positions, documents.shape[1] if documents is not None else None)
        rope = self.rope(start, tokens.shape[1]) if positions is None else self.rope(start, tokens.shape[1], positions)
        for block in self.layers.values():
            h = block(h, rope, cache, start, labels, **extra)
        return self.head(h, target)

    # The three parts of ``forward``, callable on their own (a pipeline stage runs some of them).
    def embed_tokens(
        self, tokens: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None, bound: int | None = None
    ) -> torch.Tensor:
        """Token (and, for gpt2, position) embeddings of ``tokens [B, T]`` at positions ``start..`` (or each row's
        ``positions [B, T]``, below ``bound`` where the caller knows it: otherwise read, a host sync), after dropout."""
        t = tokens.shape[1]
        last = start + t if positions is None else (bound if bound is not None else int(positions.max()) + 1)
        if last > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {last} tokens is longer than model.max_seq_len={self.cfg.max_seq_len}")
        h = self.embed(tokens)
        if self.pos_embed is not None:
            h = h + self.pos_embed(
                torch.arange(start, start + t, device=tokens.device) if positions is None else positions
            )
        return self.embed_drop(h)

    def rope(
        self, start: int, length: int, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables of positions ``start..start+length`` ``[T, D]``, or of each row's ``positions [B, T]``
        ``[B, T, D]`` (None for learned positions)."""
        if self.rope_cos is None:
            return None
        if positions is not None:
            return self.rope_cos[positions], self.rope_sin[positions]
        return self.rope_cos[start : start + length], self.rope_sin[start : start + length]

    def document_mask(self, documents: torch.Tensor, device: torch.device) -> DocumentMask:
        """The attention mask and positions of packed documents ``[B, T]`` (context parallelism swaps in its own)."""
        return DocumentMask(documents, device=device)

    def head(self, h: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and output projection: hidden states in, logits out; with ``target``, the mean token
        cross-entropy."""
        h = self.norm(h)
        if target is None:
            return self.output(h)
        return self.loss(h, self.output, target)

    # ---- initialization -------------------------------------------------------------------
    def to_empty(self, *, device, recurse: bool = True) -> Transformer:
        """Allocates uninitialized storage on ``device``, keeping a tied output projection tied."""
        super().to_empty(device=device, recurse=recurse)
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
        """Recomputes the rotary tables from the config (:func:`~trickles.models.rope.rope_tables`, scaled by
        ``model.rope_type``)."""
        if self.rope_cos is not None:
            c = self.cfg
            cos, sin = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta, self.rope_cos.device, RopeScaling.of(c))
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def new_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        p = next(self.parameters())
        # key/value heads this model holds (fewer than cfg.kv_heads when a parallel plan split them)
        attn = next(iter(self.layers.values())).attn
        if attn.fused:
            kv_heads = attn.qkv_proj.out_features // ((attn.rep + 2) * self.cfg.head_dim)
        else:
            kv_heads = attn.k_proj.out_features // self.cfg.head_dim
        return KVCache(self.cfg.n_layers, batch, kv_heads, max_len, self.cfg.head_dim, dtype or p.dtype, p.device)


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's name (stable across processes)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full initial value of parameter ``name`` (fp32, CPU), independent of any layout.

    Norm weights are one, biases zero, other weights ``N(0, init_std)``; the projections that
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
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
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
