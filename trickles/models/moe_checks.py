"""The ``[model]`` checks of a mixture of experts' routing (:func:`check_routing`, called by
:meth:`~trickles.models.config.ModelConfig.validate`)."""

from __future__ import annotations

from ..errors import ConfigError


def check_routing(cfg) -> None:
    """One-line ConfigErrors for the routing settings of a :class:`~trickles.models.config.ModelConfig` with experts
    that cannot work together."""
    e, k, g = cfg.moe_experts, cfg.moe_top_k, cfg.moe_groups
    if g < 1 or e % g:
        raise ConfigError(f"model.moe_groups ({g}) must divide model.moe_experts ({e}) into equal groups")
    chosen = g if cfg.moe_topk_groups is None else cfg.moe_topk_groups
    if not 1 <= chosen <= g:
        raise ConfigError(f"model.moe_topk_groups must be between 1 and model.moe_groups ({g}), got {chosen}")
    if k > chosen * (e // g):
        raise ConfigError(
            f"model.moe_top_k ({k}) exceeds the {chosen * (e // g)} experts that model.moe_topk_groups={chosen} "
            f"groups of {e // g} hold; raise model.moe_topk_groups or lower model.moe_top_k"
        )
    if g > 1 and e // g < 2:
        raise ConfigError(
            f"group-limited routing scores each group by its two best experts: give model.moe_groups "
            f"({g}) groups of at least 2 of the model.moe_experts ({e})"
        )
    for key in ("moe_bias_rate", "moe_routed_scale"):
        if not getattr(cfg, key) >= 0:
            raise ConfigError(f"model.{key} must be at least 0, got {getattr(cfg, key)}")
    if cfg.moe_shared_ffn_hidden is not None and cfg.moe_shared_ffn_hidden < 1:
        raise ConfigError(f"model.moe_shared_ffn_hidden must be at least 1, got {cfg.moe_shared_ffn_hidden}")
    if (cfg.moe_shared_gate or cfg.moe_shared_ffn_hidden is not None) and not cfg.moe_shared_experts:
        raise ConfigError(
            "model.moe_shared_gate and model.moe_shared_ffn_hidden shape the shared experts; set "
            "model.moe_shared_experts >= 1 or leave them unset"
        )
    if cfg.moe_router == "hard" and (cfg.moe_router_score != "softmax" or g > 1 or cfg.moe_bias_rate):
        raise ConfigError(
            "hard routing fixes each label's experts: use it with model.moe_router_score=softmax, "
            "model.moe_groups=1 and model.moe_bias_rate=0"
        )
