"""What the families share: refusals, merged defaults, the llama-style keys and tensor names.

A family module (:mod:`trickles.models.families`) builds on these; none of them knows a family by name.
"""

from __future__ import annotations

from ...errors import CheckpointError, ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..masks import layer_window
from ..rope import rope_fields_to_hf


def refuse(source: str, what: str) -> CheckpointError:
    """The one-line refusal of a ``config.json`` field this model cannot reproduce exactly."""
    return CheckpointError(f"{source}: {what}, which trickles' transformer cannot represent exactly")


def merged(defaults: dict, raw: dict) -> dict:
    """``raw`` over transformers' ``defaults`` (a null in ``raw`` keeps the default of a field that has one)."""
    return {**defaults, **{k: v for k, v in raw.items() if v is not None or k not in defaults}}


def silu_only(c: dict, source: str) -> None:
    if c["hidden_act"] not in ("silu", "swish"):
        raise refuse(source, f"hidden_act={c['hidden_act']!r} (only silu)")


def llama_shape(c: dict, source: str, family: str, **fields) -> ModelConfig:
    """The :class:`ModelConfig` of a llama-style ``config.json`` (``c``: merged with its defaults); ``fields``
    are the family's own (biases, experts, rotary base). An explicit ``head_dim`` other than
    ``hidden_size / num_attention_heads`` (a pruned model) is ``model.head_size``. A family whose MLP activation is
    not silu gives it as ``mlp_activation`` (``hidden_act`` is then not read)."""
    if "mlp_activation" not in fields:
        silu_only(c, source)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim")
    return ModelConfig(
        flavor="llama",
        family=family,
        n_layers=c["num_hidden_layers"],
        d_model=hidden,
        n_heads=heads,
        n_kv_heads=c["num_key_value_heads"] or heads,
        head_size=head_dim if head_dim is not None and head_dim * heads != hidden else None,
        ffn_hidden=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_seq_len=c["max_position_embeddings"],
        norm_eps=float(c["rms_norm_eps"]),
        dropout=0.0,
        tie_embeddings=bool(c["tie_word_embeddings"]),
        init_std=float(c["initializer_range"]),
        **fields,
    )


def qwen_windows(c: dict, source: str) -> dict:
    """``model.sliding_window`` and ``model.window_layers`` of a Qwen2/Qwen3 ``config.json``, as transformers'
    ``Qwen2Config`` reads it: windows only with ``use_sliding_window``; layer ``i`` slides where ``layer_types[i]`` is
    ``sliding_attention``, or, without ``layer_types``, where ``i >= max_window_layers``."""
    window = c.get("sliding_window", 4096) if c.get("use_sliding_window") else None
    types = c.get("layer_types")
    if types is None:
        first = c.get("max_window_layers", 28)
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(c["num_hidden_layers"])
        ]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise refuse(source, f"layer_types={types} (only sliding_attention and full_attention are built)")
    if window is None and "sliding_attention" in types:
        raise refuse(source, "layer_types names sliding_attention layers but use_sliding_window is false (no window)")
    pattern = [t == "sliding_attention" for t in types]
    return dict(sliding_window=window, window_layers=pattern) if window is not None and any(pattern) else {}


def typed_windows(types, window, source: str, n_layers: int) -> dict:
    """``model.sliding_window`` and ``model.window_layers`` of a ``layer_types`` list (``sliding_attention`` layers
    slide by ``window``; ``full_attention`` ones attend to every earlier key), refusing other types, a list whose
    length is not ``n_layers`` and sliding layers without a window."""
    if not isinstance(types, list) or len(types) != n_layers:
        raise refuse(source, f"layer_types={types!r} (give one entry per layer, {n_layers})")
    if set(types) - {"sliding_attention", "full_attention"}:
        raise refuse(source, f"layer_types={types} (only sliding_attention and full_attention are built)")
    pattern = [t == "sliding_attention" for t in types]
    if not any(pattern):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise refuse(source, f"sliding_window={window!r} with sliding_attention layers (give a window of at least 1)")
    return dict(sliding_window=window, window_layers=pattern)


def layer_types(cfg: ModelConfig) -> list[str]:
    """The ``layer_types`` list of ``cfg``: ``sliding_attention`` where a layer slides, else ``full_attention``."""
    return [("sliding" if layer_window(cfg, i) else "full") + "_attention" for i in range(cfg.n_layers)]


def qwen_window_keys(cfg: ModelConfig) -> dict:
    """The Qwen2/Qwen3 ``config.json`` keys of ``cfg``'s sliding windows (the inverse of :func:`qwen_windows`)."""
    return dict(
        use_sliding_window=cfg.sliding_window is not None,
        sliding_window=cfg.sliding_window,
        max_window_layers=cfg.n_layers,
        layer_types=layer_types(cfg),
    )


def require_norms(cfg: ModelConfig, family: str, qk_norm: str = "none", placement: str = "pre") -> None:
    """ConfigError unless ``cfg``'s q/k norm and norm placement are ``family``'s."""
    for key, want in (("qk_norm", qk_norm), ("norm_placement", placement)):
        if getattr(cfg, key) != want:
            raise ConfigError(
                f"{family} has model.{key}={want}, but this model has {getattr(cfg, key)}; set model.family to one "
                "that has it (docs/model-families.md) or unset model.family"
            )


def require_no_gemma_parts(cfg: ModelConfig, architecture: str) -> None:
    """ConfigError if ``cfg`` has one of Gemma's parts, which ``architecture`` (not a Gemma) does not have."""
    on = [k for k in ("embed_scale", "norm_unit_offset") if getattr(cfg, k)]
    on += [f"mlp_activation={cfg.mlp_activation}"] if cfg.mlp_activation != "silu" else []
    on += [k for k in ("attn_softcap", "final_softcap", "rope_local_theta") if getattr(cfg, k) is not None]
    scalar = cfg.query_pre_attn_scalar
    on += ["query_pre_attn_scalar"] if scalar is not None and scalar != cfg.head_dim else []
    if on:
        raise ConfigError(
            f"{architecture} has no model.{on[0]}; set model.family=gemma2 or gemma3_text (with every Gemma part), "
            "or leave it unset"
        )


def llama_keys(
    cfg: ModelConfig,
    model_type: str,
    architecture: str,
    ffn: int,
    qk_norm: str = "none",
    placement: str = "pre",
    gemma: bool = False,
) -> dict:
    """The ``config.json`` keys every llama-style family writes alike (ConfigError unless ``cfg``'s q/k norm and
    norm placement are the family's ``qk_norm`` and ``placement``, or, unless the family is a ``gemma``, if ``cfg``
    has one of Gemma's parts)."""
    require_norms(cfg, architecture, qk_norm, placement)
    if not gemma:
        require_no_gemma_parts(cfg, architecture)
    return dict(
        architectures=[architecture],
        model_type=model_type,
        hidden_size=cfg.d_model,
        intermediate_size=ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        attention_dropout=cfg.dropout,
        **rope_fields_to_hf(cfg),
    )


def dense_llama(cfg: ModelConfig) -> bool:
    """A llama-flavour model without experts: what every dense llama-like family writes."""
    return cfg.flavor == "llama" and not cfg.moe_experts and cfg.attention == "mha"


def require_dense_llama(cfg: ModelConfig, model_type: str) -> None:
    """Refuses, in one line, to export as ``model_type`` a model that is not a dense llama-flavour one."""
    if not dense_llama(cfg):
        raise ConfigError(
            f"model.family={model_type} needs a dense llama-flavour model; unset model.family to export this one"
        )


def attention_biases(c: dict, source: str) -> dict:
    """``qkv_bias``, ``o_bias``, ``mlp_bias`` of a ``config.json`` (``c``: merged with its defaults) whose
    ``attention_bias`` puts a bias on q, k, v **and** o and whose MLP has none (Qwen3, OLMo 2, Gemma, Qwen3-MoE)."""
    if not isinstance(c["attention_bias"], bool):
        raise refuse(source, f"attention_bias={c['attention_bias']!r} is not true or false")
    attn = c["attention_bias"]
    return dict(qkv_bias=attn, o_bias=attn, mlp_bias=False)


def attention_bias_key(cfg: ModelConfig, family: str) -> dict:
    """The ``attention_bias`` key of ``cfg`` for a family whose attention bias is on q, k, v and o alike and whose MLP
    has none (the inverse of :func:`attention_biases`; ConfigError for other biases)."""
    attn = cfg.bias("qkv")
    require_biases(
        cfg,
        f"{family} (attention_bias)",
        attn,
        attn,
        False,
        f"{family}'s attention_bias is on q, k, v and o alike, its MLP has none: set them so, or unset model.family",
    )
    return dict(attention_bias=attn)


def require_biases(cfg: ModelConfig, family: str, qkv: bool, o: bool, mlp: bool, hint: str) -> None:
    """ConfigError unless ``cfg``'s biases are exactly ``family``'s (``hint``: what to change)."""
    want = {"qkv": qkv, "o": o, "mlp": mlp}
    for part, value in want.items():
        if cfg.bias(part) != value:
            raise ConfigError(
                f"{family} has {'a' if value else 'no'} bias on its {part} projections, but "
                f"model.{part}_bias={str(cfg.bias(part)).lower()}; {hint}"
            )


#: a block's norms in transformers' llama-style names, by ``model.norm_placement``: (theirs, ours)
NORM_NAMES = {
    "pre": (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")),
    "post": (("post_attention_layernorm", "attn_post_norm"), ("post_feedforward_layernorm", "mlp_post_norm")),
    "sandwich": (
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "attn_post_norm"),
        ("pre_feedforward_layernorm", "mlp_norm"),
        ("post_feedforward_layernorm", "mlp_post_norm"),
    ),
}


def llama_names(cfg: ModelConfig, moe_entries=None) -> list[Entry]:
    """The llama-style tensor names (every tensor copied as is, ``[out, in]`` like ``nn.Linear``), with each
    projection's ``.bias`` where ``cfg`` has one; ``moe_entries(i, hf, us)``: a mixture-of-experts block's MLP."""
    b = {part: cfg.bias(part) for part in ("qkv", "o", "mlp")}
    norms = NORM_NAMES[cfg.norm_placement]
    out = [Entry("model.embed_tokens.weight", ("embed.weight",))]
    for i in range(cfg.n_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        out += [Entry(f"{hf}{theirs}.weight", (f"{us}{ours}.weight",)) for theirs, ours in norms]
        for p in "qkvo":
            leaves = ("weight", "bias") if b["o" if p == "o" else "qkv"] else ("weight",)
            out += [Entry(f"{hf}self_attn.{p}_proj.{leaf}", (f"{us}attn.{p}_proj.{leaf}",)) for leaf in leaves]
        if cfg.qk_norm != "none":
            out += [Entry(f"{hf}self_attn.{p}_norm.weight", (f"{us}attn.{p}_norm.weight",)) for p in "qk"]
        if i in cfg.moe_layers:
            out += moe_entries(i, hf, us)
        else:
            leaves = ("weight", "bias") if b["mlp"] else ("weight",)
            out += [
                Entry(f"{hf}mlp.{p}_proj.{leaf}", (f"{us}mlp.{p}_proj.{leaf}",))
                for p in ("gate", "up", "down")
                for leaf in leaves
            ]
    out.append(Entry("model.norm.weight", ("norm.weight",)))
    return out
