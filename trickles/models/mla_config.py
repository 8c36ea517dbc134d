"""The checks of multi-head latent attention's ``[model]`` fields (``model.attention = "mla"``,
:mod:`trickles.models.mla`): one-line :class:`~trickles.errors.ConfigError` each, saying what to change."""

from __future__ import annotations

from ..errors import ConfigError

#: the latent attention fields and the values that leave them unset (read only with ``model.attention = "mla"``)
MLA_FIELDS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": False,
}
#: options of the multi-head attention part the latent one does not build, with their off values
_NOT_BUILT = (
    ("flavor", "llama"),
    ("head_size", None),
    ("qk_norm", "none"),
    ("sliding_window", None),
    ("attn_softcap", None),
    ("query_pre_attn_scalar", None),
    ("rope_local_theta", None),
)


def check_mla(cfg) -> None:
    """Raises ConfigError for a :class:`~trickles.models.config.ModelConfig` whose attention part cannot be built:
    an unknown ``model.attention``; with ``mha``, a latent field changed (it would be ignored); with ``mla``, a size
    below 1, a latent rank above ``d_model``, an odd ``qk_rope_head_dim``, or an option of the other part."""
    if cfg.attention not in ("mha", "mla"):
        raise ConfigError(f"model.attention must be mha or mla, got {cfg.attention!r}")
    if cfg.attention == "mha":
        for key, unset in MLA_FIELDS.items():
            if getattr(cfg, key) != unset:
                raise ConfigError(f"model.{key} is read with model.attention=mla only; set attention=mla or unset it")
        return
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(cfg, key)
        if (value is not None or key != "q_lora_rank") and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"model.{key} must be an integer, got {value!r}")
        if value is not None and value < 1:
            raise ConfigError(f"model.{key} must be at least 1, got {value}")
    for key in ("q_lora_rank", "kv_lora_rank"):
        value = getattr(cfg, key)
        if value is not None and value > cfg.d_model:
            raise ConfigError(
                f"model.{key} ({value}) is above the width model.d_model ({cfg.d_model}); a latent rank compresses, "
                "make it at most d_model"
            )
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(
            f"model.qk_rope_head_dim ({cfg.qk_rope_head_dim}) must be even: rotary turns pairs of dimensions"
        )
    if cfg.fused_proj:
        raise ConfigError("model.fused_proj=true is not built with model.attention=mla; leave it unset")
    for key, off in _NOT_BUILT:
        if getattr(cfg, key) != off:
            raise ConfigError(
                f"model.{key}={getattr(cfg, key)} is not built with model.attention=mla; "
                f"{'set it to ' + off if off else 'leave it unset'}"
            )


def latent_linears(cfg) -> list[tuple[str, int, int, bool]]:
    """``(name, in, out, replicated)`` of a latent attention block's linears, in the order they run (module
    docstring); ``replicated``: whole on every tensor-parallel rank (else split by heads)."""
    d, h, rank, r = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    k, nv = cfg.qk_nope_head_dim + r, cfg.qk_nope_head_dim + cfg.v_head_dim
    if cfg.q_lora_rank is None:
        query = [("q_proj", d, h * k, False)]
    else:
        query = [("q_a_proj", d, cfg.q_lora_rank, True), ("q_b_proj", cfg.q_lora_rank, h * k, False)]
    latent = [("kv_a_proj_with_mqa", d, rank + r, True), ("kv_b_proj", rank, h * nv, False)]
    return query + latent + [("o_proj", h * cfg.v_head_dim, d, False)]


def latent_params(cfg) -> tuple[int, int]:
    """``(split, whole)``: a latent attention block's parameter elements that tensor parallelism splits by heads, and
    those every rank holds whole (the compressions, their norms and biases, ``o_proj``'s bias)."""
    split = whole = 0
    for _, n_in, n_out, replicated in latent_linears(cfg):
        if replicated:
            whole += n_in * n_out
        else:
            split += n_in * n_out
    whole += cfg.kv_lora_rank + (cfg.q_lora_rank or 0)  # the latent norms' weights
    if cfg.bias("qkv"):  # q_a_proj's and kv_a_proj_with_mqa's
        whole += (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if cfg.bias("o"):
        whole += cfg.d_model
    return split, whole
