"""The named shapes (``model.preset``): small ones for tests and demos, and the released models' own (their
config.json files: Llama 3.1/3.2, Mistral, Qwen2.5, Qwen3, Gemma 2/3, Phi-3, GPT-2; the mixtures of experts Qwen2-MoE,
Qwen3-MoE and DeepSeek-V3), with :func:`apply_preset` that
starts a :class:`~trickles.models.config.ModelConfig` from one."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from .config import ModelConfig


def _llama(n_layers, d_model, n_heads, n_kv_heads, ffn_hidden, vocab_size, **extra):
    return dict(
        flavor="llama",
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_hidden=ffn_hidden,
        vocab_size=vocab_size,
        **extra,
    )


def _gpt2(n_layers, d_model, n_heads):
    return dict(
        flavor="gpt2",
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=None,
        ffn_hidden=None,
        vocab_size=50257,
        max_seq_len=1024,
    )


#: Named shapes. The small ones train on a CPU; the large ones are for planning and GPU runs.
_LLAMA3 = dict(
    family="llama",
    rope_theta=500000.0,
    rope_type="llama3",
    rope_original_max_positions=8192,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
)
_QWEN = dict(rope_theta=1e6, norm_eps=1e-6)
_QWEN3 = dict(_QWEN, family="qwen3", head_size=128, qk_norm="head")
_GEMMA = dict(
    embed_scale=True,
    norm_unit_offset=True,
    mlp_activation="gelu_tanh",
    norm_placement="sandwich",
    norm_eps=1e-6,
    tie_embeddings=True,
)


def _gemma2(n_layers, d_model, n_heads, n_kv_heads, ffn_hidden, head_size, scalar):
    """Gemma 2: local (window 4096) and global layers alternating from a local one, soft-capped scores/logits."""
    return _llama(
        n_layers, d_model, n_heads, n_kv_heads, ffn_hidden, 256000, **_GEMMA, family="gemma2", head_size=head_size,
        query_pre_attn_scalar=scalar, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096,
        window_layers=[i % 2 == 0 for i in range(n_layers)],
    )  # fmt: skip


def _gemma3(n_layers, d_model, n_heads, n_kv_heads, ffn_hidden):
    """Gemma 3 (text): five local layers (window 1024, base 1e4) per global one (base 1e6, linear factor 8)."""
    return _llama(
        n_layers, d_model, n_heads, n_kv_heads, ffn_hidden, 262208, **_GEMMA, family="gemma3_text", head_size=256,
        qk_norm="head", query_pre_attn_scalar=256.0, sliding_window=1024,
        window_layers=[(i + 1) % 6 != 0 for i in range(n_layers)], rope_theta=1e6, rope_local_theta=1e4,
        rope_type="linear", rope_factor=8.0,
    )  # fmt: skip


_QWEN_MOE = dict(moe_aux_loss=0.001, moe_z_loss=0.0)  # dropless softmax top-k, no z-loss


def _qwen3_moe(n_layers, d_model, n_heads, ffn_hidden, moe_ffn_hidden):
    """Qwen3-MoE: 128 experts, 8 a token, top-k weights renormalized, no shared expert, every block MoE."""
    return _llama(
        n_layers, d_model, n_heads, 4, ffn_hidden, 151936, **{**_QWEN3, "family": "qwen3_moe"}, **_QWEN_MOE,
        moe_experts=128, moe_top_k=8, moe_ffn_hidden=moe_ffn_hidden, moe_norm_topk=True,
    )  # fmt: skip


#: DeepSeek-V3 (671B, 37B active): latent attention, yarn x40 from 4,096 positions, 3 dense blocks then 58 DeepSeekMoE
#: ones (256 routed experts of 2,048 in 8 groups, 8 a token from 4 groups, one shared), sigmoid scores balanced by
#: the routing bias (gamma 0.001) and the sequence-wise loss (alpha 0.0001 in the report; 0.001 in config.json)
_DEEPSEEK_V3 = _llama(
    61, 7168, 128, 128, 18432, 129280, family="deepseek_v3", attention="mla", q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, norm_eps=1e-6,
    rope_type="yarn", rope_factor=40.0, rope_original_max_positions=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0,
    moe_experts=256, moe_top_k=8, moe_ffn_hidden=2048, moe_shared_experts=1, moe_first_dense=3,
    moe_router_score="sigmoid", moe_groups=8, moe_topk_groups=4, moe_routed_scale=2.5, moe_norm_topk=True,
    moe_bias_rate=0.001, moe_aux_loss=0.001, moe_z_loss=0.0,
)  # fmt: skip

PRESETS: dict[str, dict] = {
    "tiny": _llama(2, 64, 4, 2, 128, None),
    "demo": _llama(4, 256, 8, 4, None, None),
    "llama-125m": _llama(12, 768, 12, 12, 2048, 32000),
    "llama-350m": _llama(24, 1024, 16, 8, 2816, 32000),
    "llama-1b": _llama(16, 2048, 32, 8, 8192, 128256, rope_theta=500000.0, tie_embeddings=True),
    "llama-3b": _llama(28, 3072, 24, 8, 8192, 128256, rope_theta=500000.0, tie_embeddings=True),
    "llama-7b": _llama(32, 4096, 32, 32, 11008, 32000),
    # the released models' shapes (their config.json files), for memory, plan and training from scratch
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, 128256, **_LLAMA3, rope_factor=32.0, tie_embeddings=True),
    "llama3.2-3b": _llama(28, 3072, 24, 8, 8192, 128256, **_LLAMA3, rope_factor=32.0, tie_embeddings=True),
    "llama3.1-8b": _llama(32, 4096, 32, 8, 14336, 128256, **_LLAMA3, rope_factor=8.0),
    "llama3.1-70b": _llama(80, 8192, 64, 8, 28672, 128256, **_LLAMA3, rope_factor=8.0),
    "llama3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, **_LLAMA3, rope_factor=8.0),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32768, family="mistral", rope_theta=1e6),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, 152064, **_QWEN, family="qwen2", qkv_bias=True),
    "qwen2.5-72b": _llama(80, 8192, 64, 8, 29568, 152064, **_QWEN, family="qwen2", qkv_bias=True),
    "qwen3-0.6b": _llama(28, 1024, 16, 8, 3072, 151936, **_QWEN3, tie_embeddings=True),
    "qwen3-8b": _llama(36, 4096, 32, 8, 12288, 151936, **_QWEN3),
    "qwen3-32b": _llama(64, 5120, 64, 8, 25600, 151936, **_QWEN3),
    "gemma2-9b": _gemma2(42, 3584, 16, 8, 14336, 256, 256.0),
    "gemma2-27b": _gemma2(46, 4608, 32, 16, 36864, 128, 144.0),
    "gemma3-12b": _gemma3(48, 3840, 16, 8, 15360),
    # Phi-3-mini-4k: a window of 2047 keys on every layer
    "phi3-mini": _llama(32, 3072, 32, 32, 8192, 32064, family="phi3", norm_eps=1e-5, sliding_window=2047),
    # mixtures of experts
    "qwen2-57b-a14b": _llama(
        28,
        3584,
        28,
        4,
        18944,
        151936,
        **_QWEN,
        family="qwen2_moe",
        qkv_bias=True,
        **_QWEN_MOE,
        moe_experts=64,
        moe_top_k=8,
        moe_ffn_hidden=2560,
        moe_norm_topk=False,
        moe_shared_experts=1,
        moe_shared_ffn_hidden=20480,
        moe_shared_gate=True,
    ),  # fmt: skip
    "qwen3-30b-a3b": _qwen3_moe(48, 2048, 32, 6144, 768),
    "qwen3-235b-a22b": _qwen3_moe(94, 4096, 64, 12288, 1536),
    "deepseek-v3": _DEEPSEEK_V3,
    "gpt2-tiny": dict(_gpt2(2, 64, 4), vocab_size=None, max_seq_len=None),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
}


def apply_preset(cfg: ModelConfig, name: str) -> ModelConfig:
    """``cfg`` with the preset's values (fields the preset does not name keep their defaults)."""
    if name not in PRESETS:
        import difflib

        hint = difflib.get_close_matches(name, PRESETS, n=1)
        raise ConfigError(
            f"unknown model.preset {name!r}"
            + (f"; did you mean {hint[0]!r}?" if hint else f"; choose one of {', '.join(PRESETS)}")
        )
    defaults = ModelConfig()
    base = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(ModelConfig)}
    base.update(PRESETS[name])
    base["preset"] = name
    return dataclasses.replace(cfg, **base)
