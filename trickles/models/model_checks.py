"""The ``[model]`` section's checks: every shape no transformer can have gets one line that says what to change."""

from __future__ import annotations

from ..errors import ConfigError
from .mla_config import check_mla
from .moe_checks import check_routing
from .rope import RopeScaling


def check_model(cfg) -> None:
    """Raises ConfigError for shapes no transformer can have (``cfg``: a :class:`~.config.ModelConfig`)."""
    for key in ("n_layers", "d_model", "n_heads"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"model.{key} must be at least 1, got {getattr(cfg, key)}")
    if cfg.head_size is not None and cfg.head_size < 1:
        raise ConfigError(f"model.head_size must be at least 1 or none (d_model / n_heads), got {cfg.head_size}")
    check_mla(cfg)
    if cfg.attention == "mha" and cfg.head_size is None and cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"model.d_model ({cfg.d_model}) must be divisible by model.n_heads ({cfg.n_heads}); change one of them"
        )
    if cfg.attention == "mha" and cfg.n_kv_heads is not None and (cfg.n_kv_heads < 1 or cfg.n_heads % cfg.n_kv_heads):
        raise ConfigError(
            f"model.n_heads ({cfg.n_heads}) must be a multiple of model.n_kv_heads ({cfg.n_kv_heads}); change "
            "n_kv_heads to a divisor of n_heads"
        )
    if cfg.flavor == "llama" and cfg.rope_dim % 2:
        raise ConfigError(
            f"rotary embeddings need an even head size, but the head size is {cfg.head_dim}; change "
            "model.d_model, model.n_heads or model.head_size"
        )
    RopeScaling.of(cfg).check(cfg.rope_theta, cfg.flavor)
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {cfg.dropout}")
    if cfg.vocab_size is not None and cfg.vocab_size < 2:
        raise ConfigError(f"model.vocab_size must be at least 2, got {cfg.vocab_size}")
    if cfg.moe_experts:
        if cfg.moe_experts < 2:
            raise ConfigError(f"model.moe_experts must be 0 (dense) or at least 2, got {cfg.moe_experts}")
        if not 1 <= cfg.moe_top_k <= cfg.moe_experts:
            raise ConfigError(
                f"model.moe_top_k must be between 1 and model.moe_experts ({cfg.moe_experts}), got {cfg.moe_top_k}"
            )
        if cfg.moe_every < 1:
            raise ConfigError(f"model.moe_every must be at least 1, got {cfg.moe_every}")
        if not 0 <= cfg.moe_first_dense < cfg.n_layers:
            raise ConfigError(
                f"model.moe_first_dense ({cfg.moe_first_dense}) must be from 0 to model.n_layers - 1 "
                f"({cfg.n_layers - 1}), or no block has experts; lower it or set model.moe_experts=0"
            )
        if cfg.moe_ffn_hidden is not None and cfg.moe_ffn_hidden < 1:
            raise ConfigError(f"model.moe_ffn_hidden must be at least 1, got {cfg.moe_ffn_hidden}")
        for key in ("moe_capacity_factor", "moe_aux_loss", "moe_z_loss", "moe_shared_experts"):
            if not getattr(cfg, key) >= 0:
                raise ConfigError(f"model.{key} must be at least 0, got {getattr(cfg, key)}")
        if cfg.moe_router == "hard":
            table = cfg.label_experts
            if not table:
                raise ConfigError("model.moe_router=hard needs model.moe_label_experts, e.g. ['json:0', 'email:1']")
            if len(table) != len(cfg.moe_label_experts):
                raise ConfigError("model.moe_label_experts names a label twice; give each label once")
            sizes = {len(v) for v in table.values()}
            bad = [e for v in table.values() for e in v if not 0 <= e < cfg.moe_experts]
            if bad:
                raise ConfigError(
                    f"model.moe_label_experts names expert {bad[0]}, but there are {cfg.moe_experts} "
                    f"(0..{cfg.moe_experts - 1})"
                )
            if len(sizes) != 1 or sizes != {cfg.moe_top_k} or any(len(set(v)) != len(v) for v in table.values()):
                raise ConfigError(
                    f"hard routing sends each token to all of its label's experts: every label of "
                    f"model.moe_label_experts must name model.moe_top_k ({cfg.moe_top_k}) distinct experts"
                )
        check_routing(cfg)
    if cfg.flavor == "gpt2" and not all(cfg.bias(p) for p in ("qkv", "o", "mlp")):
        raise ConfigError(
            "gpt2 has a bias on every projection; leave model.qkv_bias, o_bias and mlp_bias unset for a gpt2 model"
        )
    if cfg.qk_norm != "none" and cfg.flavor != "llama":
        raise ConfigError(
            f"model.qk_norm={cfg.qk_norm} normalizes rotary queries and keys (llama flavor); set model.qk_norm=none"
        )
    if cfg.mlp_bias and cfg.moe_experts:
        raise ConfigError(
            "model.mlp_bias is built for dense MLPs only; set model.mlp_bias=false or model.moe_experts=0"
        )
    if cfg.loss_chunk < 0:
        raise ConfigError(f"model.loss_chunk must be 0 (automatic) or a number of tokens, got {cfg.loss_chunk}")
    if cfg.kernels == "triton":
        from ..kernels import HAVE_TRITON

        if not HAVE_TRITON:
            raise ConfigError("model.kernels=triton needs Triton (pip install triton); use model.kernels=auto or torch")
    if cfg.max_seq_len is not None and cfg.max_seq_len < 1:
        raise ConfigError(f"model.max_seq_len must be at least 1, got {cfg.max_seq_len}")
    if cfg.sliding_window is not None and cfg.sliding_window < 1:
        raise ConfigError(f"model.sliding_window must be at least 1 or none, got {cfg.sliding_window}")
    if cfg.window_layers is not None and len(cfg.window_layers) != cfg.n_layers:
        raise ConfigError(f"model.window_layers has {len(cfg.window_layers)} entries; give {cfg.n_layers}")
    _check_gemma_parts(cfg)
    _check_mtp(cfg)


def _check_gemma_parts(cfg) -> None:
    """The Gemma pieces: positive caps and scalars, llama flavor, a window for the local rotary base."""
    for key in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_local_theta"):
        value = getattr(cfg, key)
        if value is not None and not value > 0:
            raise ConfigError(f"model.{key} must be positive or none, got {value}")
    on = [
        k
        for k in ("norm_unit_offset", "embed_scale", "query_pre_attn_scalar", "attn_softcap", "final_softcap")
        if getattr(cfg, k) not in (None, False)
    ]
    if cfg.mlp_activation != "silu":
        on.append(f"mlp_activation={cfg.mlp_activation}")
    if cfg.rope_local_theta is not None:
        on.append("rope_local_theta")
    if on and cfg.flavor != "llama":
        raise ConfigError(f"model.{on[0]} is built for the llama flavor; set model.flavor=llama or leave it unset")
    if cfg.mlp_activation != "silu" and cfg.moe_experts:
        raise ConfigError(
            f"model.mlp_activation={cfg.mlp_activation} is built for dense MLPs only; set model.moe_experts=0 "
            "or model.mlp_activation=silu"
        )
    if cfg.rope_local_theta is not None and cfg.sliding_window is None:
        raise ConfigError(
            "model.rope_local_theta is the rotary base of the sliding-window layers; set model.sliding_window "
            "or leave rope_local_theta unset"
        )


def _check_mtp(cfg) -> None:
    """Multi-token prediction: a depth and weight that exist, and a sequence with a token past each depth."""
    if cfg.mtp_depth < 0:
        raise ConfigError(f"model.mtp_depth must be 0 (off) or a number of depths, got {cfg.mtp_depth}")
    if not cfg.mtp_weight >= 0:
        raise ConfigError(f"model.mtp_weight must be at least 0, got {cfg.mtp_weight}")
    if cfg.mtp_depth and cfg.max_seq_len is not None and cfg.max_seq_len <= cfg.mtp_depth:
        raise ConfigError(
            f"model.mtp_depth ({cfg.mtp_depth}) needs sequences longer than it, but model.max_seq_len is "
            f"{cfg.max_seq_len}; lower model.mtp_depth or raise model.max_seq_len"
        )


def check_mtp_layout(model, parallel, dims, seq_len: int) -> None:
    """Where multi-token prediction cannot run (``model``, ``parallel``: the config's sections; ``dims``: the degrees):
    its modules read whole sequences on the last pipeline stage, beside a copy of the embedding."""
    depth = model.mtp_depth
    if not depth:
        return
    if seq_len <= depth:
        raise ConfigError(
            f"model.mtp_depth ({depth}) predicts up to {depth + 1} tokens ahead, but data.seq_len is {seq_len}; set "
            f"data.seq_len above {depth} or lower model.mtp_depth"
        )
    for bad, what, fix in (
        (dims.cp > 1, f"parallel.cp={dims.cp} (each depth shifts whole sequences)", "parallel.cp=1"),
        (dims.tp > 1 and dims.tp_mode != "1d", f"parallel.tp_mode={dims.tp_mode}", "parallel.tp_mode=1d"),
        (
            dims.pp > 1 and parallel.schedule in ("zb-h1", "zb-v"),
            f"parallel.schedule={parallel.schedule} (its split backward)",
            "parallel.schedule=1f1b, interleaved or gpipe",
        ),
        (
            dims.pp > 1 and parallel.zero == 3,
            "parallel.zero=3 at parallel.pp > 1 (the last stage holds a copy of the embedding)",
            "parallel.zero=2 (or 0, 1)",
        ),
        (
            dims.ep > 1 and _mtp_experts(model),
            f"parallel.ep={dims.ep} (the prediction blocks' experts stay whole)",
            "parallel.ep=1",
        ),
    ):
        if bad:
            raise ConfigError(f"model.mtp_depth does not run with {what} yet; use {fix} or model.mtp_depth=0")


def _mtp_experts(model) -> bool:
    """Whether a prediction block is a mixture of experts (the model's pattern past its last block)."""
    every, first, n = model.moe_every, model.moe_first_dense, model.n_layers
    return bool(model.moe_experts) and any(i >= first and i % every == every - 1 for i in range(n, n + model.mtp_depth))
