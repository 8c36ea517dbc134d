"""GPT-2 (``model_type: gpt2``, ``GPT2LMHeadModel``): LayerNorm, learned positions, tanh-GELU MLP, biases everywhere.

Config, both ways: ``n_embd`` d_model, ``n_layer`` n_layers, ``n_head`` n_heads (no grouped-query attention),
``n_inner`` ffn_hidden (null: 4 d_model), ``vocab_size``, ``n_positions`` max_seq_len, ``layer_norm_epsilon``
norm_eps, ``tie_word_embeddings`` (default true), ``initializer_range`` init_std. Refused: an
``activation_function`` other than ``gelu_new`` / ``gelu_pytorch_tanh``, ``scale_attn_weights=false``,
``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, ``add_cross_attention``; on export, grouped-query
attention or a head size other than ``d_model / n_heads``.

Tensor names: GPT-2's ``Conv1D`` stores weights ``[in, out]``, so they are transposed; ``c_attn`` is q, k and v
fused along ``out`` (in that order) and is split::

    transformer.wte.weight                  embed.weight
    transformer.wpe.weight                  pos_embed.weight
    transformer.h.{i}.ln_1.{weight,bias}    layers.{i}.attn_norm.{weight,bias}
    transformer.h.{i}.attn.c_attn.weight    layers.{i}.attn.{q,k,v}_proj.weight = split(W.T, d, dim=0)
    transformer.h.{i}.attn.c_attn.bias      layers.{i}.attn.{q,k,v}_proj.bias = split(b, d)
    transformer.h.{i}.attn.c_proj.*         layers.{i}.attn.o_proj.*        (weight transposed)
    transformer.h.{i}.ln_2.*                layers.{i}.mlp_norm.*
    transformer.h.{i}.mlp.c_fc.*            layers.{i}.mlp.up_proj.*        (weight transposed)
    transformer.h.{i}.mlp.c_proj.*          layers.{i}.mlp.down_proj.*      (weight transposed)
    transformer.ln_f.{weight,bias}          norm.{weight,bias}

Checkpoints written without the ``transformer.`` prefix (the original ``gpt2`` upload) are read too.
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from .base import merged, refuse, require_norms

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
DEFAULTS = dict(
    vocab_size=50257,
    n_positions=1024,
    n_embd=768,
    n_layer=12,
    n_head=12,
    n_inner=None,
    activation_function="gelu_new",
    layer_norm_epsilon=1e-5,
    initializer_range=0.02,
    scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False,
    add_cross_attention=False,
    tie_word_embeddings=True,
)


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    if c["activation_function"] not in ("gelu_new", "gelu_pytorch_tanh"):
        raise refuse(source, f"activation_function={c['activation_function']!r} (only gelu_new / gelu_pytorch_tanh)")
    for key, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("add_cross_attention", False),
    ):
        if bool(c[key]) != ok:
            raise refuse(source, f"{key}={str(c[key]).lower()}")
    return ModelConfig(
        flavor="gpt2",
        family=MODEL_TYPE,
        n_layers=c["n_layer"],
        d_model=c["n_embd"],
        n_heads=c["n_head"],
        n_kv_heads=None,
        ffn_hidden=c["n_inner"] or 4 * c["n_embd"],
        vocab_size=c["vocab_size"],
        max_seq_len=c["n_positions"],
        norm_eps=float(c["layer_norm_epsilon"]),
        dropout=0.0,
        tie_embeddings=bool(c["tie_word_embeddings"]),
        init_std=float(c["initializer_range"]),
    )


def picks(cfg: ModelConfig) -> bool:
    """GPT-2 writes every gpt2-flavour model (and refuses those it cannot express)."""
    return cfg.flavor == "gpt2"


def to_hf(cfg: ModelConfig) -> dict:
    if cfg.flavor != "gpt2":
        raise ConfigError(f"model.family={MODEL_TYPE} needs model.flavor=gpt2; unset model.family to export this one")
    require_norms(cfg, "GPT-2")
    if cfg.moe_experts:
        raise ConfigError(
            "Hugging Face has no GPT-2 mixture of experts (Mixtral is llama-flavoured); "
            "export a model with model.flavor=llama or model.moe_experts=0"
        )
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise ConfigError(
            f"GPT-2's heads are d_model / n_heads wide, but model.head_size={cfg.head_dim} with "
            f"{cfg.n_heads} heads and d_model={cfg.d_model}; prune a gpt2 model's MLP and blocks only to export it"
        )
    if cfg.kv_heads != cfg.n_heads:
        raise ConfigError(
            f"GPT-2 has no grouped-query attention, but model.n_kv_heads={cfg.kv_heads} != "
            f"model.n_heads={cfg.n_heads}; set model.n_kv_heads to none for a gpt2 model"
        )
    return dict(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.ffn_dim,
        n_positions=cfg.max_seq_len,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    """The names above, without the ``transformer.`` prefix where ``found`` (the checkpoint's names) has none."""
    p = "" if "transformer.wte.weight" not in found and "wte.weight" in found else "transformer."
    out = [Entry(p + "wte.weight", ("embed.weight",)), Entry(p + "wpe.weight", ("pos_embed.weight",))]
    for i in range(cfg.n_layers):
        hf, us = f"{p}h.{i}.", f"layers.{i}."
        for leaf in ("weight", "bias"):
            kind = "conv1d" if leaf == "weight" else "copy"
            out.append(Entry(f"{hf}ln_1.{leaf}", (f"{us}attn_norm.{leaf}",)))
            out.append(Entry(f"{hf}attn.c_attn.{leaf}", tuple(f"{us}attn.{x}_proj.{leaf}" for x in "qkv"), "fused"))
            out.append(Entry(f"{hf}attn.c_proj.{leaf}", (f"{us}attn.o_proj.{leaf}",), kind))
            out.append(Entry(f"{hf}ln_2.{leaf}", (f"{us}mlp_norm.{leaf}",)))
            out.append(Entry(f"{hf}mlp.c_fc.{leaf}", (f"{us}mlp.up_proj.{leaf}",), kind))
            out.append(Entry(f"{hf}mlp.c_proj.{leaf}", (f"{us}mlp.down_proj.{leaf}",), kind))
    out += [Entry(f"{p}ln_f.{leaf}", (f"norm.{leaf}",)) for leaf in ("weight", "bias")]
    return out
