"""Model shape: the ``[model]`` section, its derived sizes and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..options import opt
from .model_checks import check_model
from .rope import RopeType

Flavor = Literal["llama", "gpt2"]
QKNorm = Literal["none", "head", "full"]
NormPlacement = Literal["pre", "post", "sandwich"]
#: the [model] keys that say how the model computes, not what: a run may change them against its checkpoint
HOW_KEYS = ("kernels", "fused_loss", "loss_chunk", "fused_proj")
#: the [model] keys a run gives that a Hugging Face config.json does not hold: kept from the run's over the directory's
HF_RUN_KEYS = ("mtp_depth", "mtp_weight")


@dataclass
class ModelConfig:
    """Shape of a decoder-only transformer (the ``[model]`` section)."""

    preset: str | None = opt(
        None, "named shape to start from (trickles.models.presets.PRESETS); keys given beside it override it"
    )
    from_hf: str | None = opt(
        None,
        "take the shape from this Hugging Face model directory's config.json (no weights: for trickles memory, plan, "
        "or a model trained from scratch); shape keys given beside it must agree with it (none: these keys)",
    )
    flavor: Flavor = opt(
        "llama",
        "llama: RMSNorm, rotary, SwiGLU, biases where model.qkv_bias, o_bias, mlp_bias say; gpt2: LayerNorm, learned "
        "positions, GELU, biases",
    )
    n_layers: int = opt(4, "number of transformer blocks")
    d_model: int = opt(256, "hidden size")
    n_heads: int = opt(8, "query heads")
    n_kv_heads: int | None = opt(4, "key/value heads for grouped-query attention (none: same as n_heads)")
    head_size: int | None = opt(
        None,
        "size of each attention head (none: d_model / n_heads); set where heads were pruned, which keeps their size",
    )
    ffn_hidden: int | None = opt(
        None, "MLP hidden size (none: 4*d_model for gpt2; 8/3*d_model rounded up to ffn_multiple_of for llama)"
    )
    ffn_multiple_of: int = opt(64, "rounding of the default llama MLP hidden size")
    qkv_bias: bool | None = opt(
        None, "a bias on the query, key and value projections (none: true for gpt2, false for llama)"
    )
    o_bias: bool | None = opt(None, "a bias on the attention output projection (none: true for gpt2, false for llama)")
    mlp_bias: bool | None = opt(None, "a bias on every MLP projection (none: true for gpt2, false for llama)")
    qk_norm: QKNorm = opt(
        "none",
        "RMSNorm of queries and keys after their projections, before rotary: none; head (each head over head_dim, "
        "one weight shared by the heads: Qwen3); full (the whole projected width: OLMo 2)",
    )
    norm_placement: NormPlacement = opt(
        "pre",
        "where a block's norms sit: pre (before attention and MLP); post (on their outputs, before the residual "
        "add: OLMo 2); sandwich (both)",
    )
    norm_unit_offset: bool = opt(
        False, "every RMSNorm scales by (1 + weight), in fp32, cast at the end (Gemma); its weights start at 0"
    )
    mlp_activation: Literal["silu", "gelu_tanh"] = opt(
        "silu", "the gated MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)"
    )
    embed_scale: bool = opt(
        False, "token embeddings times sqrt(d_model), the factor rounded to the embedding's type first (Gemma)"
    )
    query_pre_attn_scalar: float | None = opt(
        None, "attention scores scaled by this ** -0.5 instead of head_dim ** -0.5 (Gemma; none: head_dim)"
    )
    attn_softcap: float | None = opt(
        None, "attention scores become cap * tanh(scores / cap) before mask and softmax (Gemma 2; none: off)"
    )
    final_softcap: float | None = opt(
        None, "output logits become cap * tanh(logits / cap), in the loss too (Gemma 2; none: off)"
    )
    attention: Literal["mha", "mla"] = opt("mha", "mha (grouped-query heads) or mla (latent attention, docs/mla.md)")
    q_lora_rank: int | None = opt(1536, "mla: rank of the low-rank query path, RMSNorm between (none: one projection)")
    kv_lora_rank: int = opt(512, "mla: width of the compressed key/value latent, what a decoding cache keeps")
    qk_nope_head_dim: int = opt(128, "mla: per-head query/key dimensions without rotary, up-projected from the latent")
    qk_rope_head_dim: int = opt(64, "mla: query/key dimensions with rotary (the key's shared by the heads)")
    v_head_dim: int = opt(128, "mla: per-head value size")
    mtp_depth: int = opt(
        0,
        "multi-token prediction (DeepSeek-V3, docs/mtp.md): D modules predicting tokens t+2 .. t+1+D from the shared "
        "embedding and output head, trained only (0: off)",
    )
    mtp_weight: float = opt(
        0.1,
        "multi-token prediction: weight of the depths' mean cross-entropy added to the training loss (DeepSeek-V3: "
        "0.3, later 0.1)",
    )
    rope_interleave: bool = opt(False, "mla: rotary dimensions in interleaved pairs (DeepSeek's), reordered to rotate")
    sliding_window: int | None = opt(None, "keys a query sees, itself included: q - window < k <= q (none: all)")
    window_layers: list[bool] | None = opt(None, "per layer, whether sliding_window applies (none: every layer)")
    family: str | None = opt(
        None,
        "the Hugging Face model_type an export writes (llama, mistral, qwen2, qwen3, olmo2, gemma2, gemma3_text, phi3, "
        "mixtral, deepseek_v3, gpt2; none: the one the model's parts pick, docs/model-families.md)",
    )
    vocab_size: int | None = opt(None, "vocabulary size (none: the tokenizer's, rounded up to vocab_multiple)")
    vocab_multiple: int = opt(64, "rounding of the vocabulary size taken from the tokenizer")
    max_seq_len: int | None = opt(None, "longest sequence the model accepts (none: data.seq_len)")
    rope_theta: float = opt(10000.0, "rotary embedding base (llama)")
    rope_local_theta: float | None = opt(
        None,
        "rotary base of the sliding-window layers, unscaled (Gemma 3's rope_local_base_freq; none: rope_theta and "
        "model.rope_type for every layer)",
    )
    rope_type: RopeType = opt(
        "default",
        "rotary frequencies (docs/model-families.md): default (rope_theta alone); linear (divided by rope_factor); "
        "llama3 (Llama 3.1: long wavelengths divided, short kept, a band blended); yarn (YaRN, by rotation counts)",
    )
    rope_factor: float = opt(1.0, "linear, llama3, yarn: how many times the original context is extended")
    rope_low_freq_factor: float = opt(1.0, "llama3: wavelengths over original/this are divided by rope_factor")
    rope_high_freq_factor: float = opt(4.0, "llama3: wavelengths under original/this are kept, between: blended")
    rope_original_max_positions: int | None = opt(None, "llama3, yarn: the pretraining context (none: max_seq_len)")
    rope_beta_fast: float = opt(32.0, "yarn: dimensions turning more often than this in the original are kept")
    rope_beta_slow: float = opt(1.0, "yarn: dimensions turning less often than this are divided by rope_factor")
    rope_attention_factor: float | None = opt(
        None, "yarn: scale of cos and sin (none: 0.1 ln(rope_factor) + 1, or the rope_mscale ratio)"
    )
    rope_mscale: float | None = opt(None, "yarn: with rope_mscale_all_dim, the attention factor's numerator mscale")
    rope_mscale_all_dim: float | None = opt(None, "yarn: with rope_mscale, its denominator's mscale")
    rope_truncate: bool = opt(True, "yarn: round the blended band's ends to whole dimensions")
    norm_eps: float = opt(1e-5, "epsilon of RMSNorm / LayerNorm")
    dropout: float = opt(0.0, "dropout on embeddings, attention probabilities and residual branches")
    tie_embeddings: bool | None = opt(
        None, "share the input embedding with the output projection (none: true for gpt2, false for llama)"
    )
    init_std: float = opt(
        0.02,
        "standard deviation of the normal initialization; residual output projections use init_std/sqrt(2*n_layers)",
    )
    kernels: Literal["auto", "triton", "torch"] = opt(
        "auto",
        "auto: per kernel, the Triton kernel (trickles.kernels) on CUDA only where its GPU measurement "
        "(trickles.kernels.MEASURED, docs/kernels.md) beat eager PyTorch and torch.compile, else eager PyTorch "
        "(an empty table: PyTorch everywhere); triton: always (a CPU needs TRITON_INTERPRET=1); torch: never",
    )
    fused_loss: bool | None = opt(
        None,
        "compute the output projection and cross-entropy chunk by chunk, never holding the [tokens, vocab] logits "
        "(none: when the kernels run the Triton cross-entropy)",
    )
    fused_proj: bool | None = opt(
        None,
        "one matmul for queries, keys and values and one for the gate and up projections, their names kept in "
        "checkpoints (none: fused with kernels=triton; with auto only on CUDA where its GPU measurement, "
        "trickles.kernels.MEASURED_PROJECTIONS, shows fusion winning; otherwise separate)",
    )
    loss_chunk: int = opt(
        0,
        "tokens per chunk of the fused loss (0: about as many as make a chunk's logits the size of the hidden states)",
    )
    moe_experts: int = opt(0, "routed experts in each mixture-of-experts block (0: every block has a dense MLP)")
    moe_top_k: int = opt(2, "experts each token is routed to")
    moe_every: int = opt(1, "every n-th block is a mixture of experts (blocks n-1, 2n-1, ...; 1: all)")
    moe_ffn_hidden: int | None = opt(None, "hidden size of each expert MLP (none: the dense MLP's)")
    moe_capacity_factor: float = opt(
        0.0,
        "each expert takes at most ceil(factor x top_k x T / experts) of a sequence's assignments, first choices "
        "first (0: dropless)",
    )
    moe_aux_loss: float = opt(0.01, "weight of the Switch/GShard load-balancing loss")
    moe_z_loss: float = opt(0.001, "weight of the router z-loss (mean squared log-sum-exp of the router logits)")
    moe_shared_experts: int = opt(
        0, "always-on experts beside the routed ones (one MLP of shared x moe_ffn_hidden units)"
    )
    moe_router: Literal["learned", "hard"] = opt(
        "learned",
        "learned: each token's top-k experts by the router; hard: the experts its sample's label maps to "
        "(model.moe_label_experts)",
    )
    moe_label_experts: list[str] = opt(
        [],
        "hard routing: 'label:expert[+expert...]' per label, e.g. json:0 email:1 (each label the same number of "
        "experts)",
    )
    moe_router_score: Literal["softmax", "sigmoid"] = opt("softmax", "expert scores: softmax or sigmoid (DeepSeek)")
    moe_groups: int = opt(1, "group-limited routing: the experts form this many equal groups (n_group; 1: none)")
    moe_topk_groups: int | None = opt(None, "groups a token may route into (topk_group, docs/moe.md; none: all)")
    moe_norm_topk: bool | None = opt(None, "divide the top-k weights by their sum (none: when model.moe_top_k > 1)")
    moe_routed_scale: float = opt(1.0, "factor on the routed experts' weights (routed_scaling_factor)")
    moe_bias_rate: float = opt(0.0, "loss-free balancing: the routing bias's step after each optimizer step (0: off)")
    moe_shared_ffn_hidden: int | None = opt(None, "the shared experts' hidden size (none: shared x moe_ffn_hidden)")
    moe_shared_gate: bool = opt(False, "scale the shared experts' output by a learned sigmoid gate (Qwen2-MoE)")
    moe_first_dense: int = opt(
        0,
        "the first k blocks keep a dense MLP (first_k_dense_replace, DeepSeek); from block k on, moe_every's pattern "
        "picks the mixture-of-experts blocks",
    )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """The query/key head size: ``head_size`` or ``d_model / n_heads`` (mla: ``qk_nope + qk_rope_head_dim``)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_size or self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The rotary tables' size: the head size (mla: ``qk_rope_head_dim``)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.flavor == "gpt2":
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)

    @property
    def moe_ffn_dim(self) -> int:
        return self.moe_ffn_hidden or self.ffn_dim

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the mixture-of-experts blocks: block ``i >= moe_first_dense`` with ``i % moe_every ==
        moe_every - 1`` (DeepSeek-V3: blocks 3 onwards; Qwen MoE: every ``decoder_sparse_step``-th)."""
        if not self.moe_experts:
            return []
        every, first = self.moe_every, self.moe_first_dense
        return [i for i in range(first, self.n_layers) if i % every == every - 1]

    @property
    def label_experts(self) -> dict[str, list[int]]:
        """Hard routing: ``{label: [experts]}`` in the order given (a label's id is its position)."""
        out = {}
        for item in self.moe_label_experts:
            label, _, experts = str(item).partition(":")
            try:
                out[label.strip()] = [int(e) for e in experts.split("+")]
            except ValueError:
                raise ConfigError(
                    f"model.moe_label_experts entry {item!r} is not 'label:expert[+expert...]', "
                    f"e.g. 'json:0' or 'email:1+2'"
                ) from None
        return out

    @property
    def fuses_projections(self) -> bool:
        """Whether the blocks use fused q/k/v and gate/up projections (:mod:`trickles.models.fused`); unset,
        :func:`~trickles.kernels.fused_proj_default` on this machine's device."""
        if self.fused_proj is not None or self.attention == "mla":  # latent attention: no fused projections
            return bool(self.fused_proj)
        import torch

        from ..kernels import fused_proj_default

        return fused_proj_default(self.kernels, "cuda" if torch.cuda.is_available() else "cpu")

    def bias(self, part: str) -> bool:
        """Whether projections ``part`` (``qkv``, ``o`` or ``mlp``) have a bias: ``model.<part>_bias``, unset the
        flavor's (gpt2: all, llama: none)."""
        value = getattr(self, f"{part}_bias")
        return self.flavor == "gpt2" if value is None else bool(value)

    @property
    def tied(self) -> bool:
        return self.flavor == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    def validate(self) -> None:
        """Raises ConfigError for shapes no transformer can have (:func:`~.model_checks.check_model`)."""
        check_model(self)


def resolve_model(cfg: ModelConfig, tokenizer_vocab: int, seq_len: int) -> ModelConfig:
    """Fills the sizes left to the data: vocabulary from the tokenizer, length from data.seq_len."""
    vocab = cfg.vocab_size
    if vocab is None:
        m = cfg.vocab_multiple
        vocab = m * ((tokenizer_vocab + m - 1) // m)
    elif vocab < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary ({tokenizer_vocab}); raise it or "
            "leave it unset"
        )
    return dataclasses.replace(cfg, vocab_size=vocab, max_seq_len=cfg.max_seq_len or seq_len)
