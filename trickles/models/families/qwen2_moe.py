"""Qwen2-MoE (``model_type: qwen2_moe``, ``Qwen2MoeForCausalLM``): Qwen2's attention (a bias on q, k and v) with
mixture-of-experts blocks whose shared expert sits behind a sigmoid gate.

Config, both ways: as :mod:`.qwen2` for attention (``qkv_bias`` is ``model.qkv_bias``; o and the MLPs have no bias),
plus softmax top-k routing, dropless, learned: ``num_experts`` moe_experts, ``num_experts_per_tok`` moe_top_k,
``moe_intermediate_size`` moe_ffn_hidden, ``norm_topk_prob`` moe_norm_topk (false by default: the top-k weights are
the raw softmax probabilities), ``router_aux_loss_coef`` moe_aux_loss, ``decoder_sparse_step`` moe_every (layer ``i``
is MoE when ``(i + 1) % step == 0``, as ``moe_every`` says), ``intermediate_size`` the dense blocks' MLP, and one
shared expert of ``shared_expert_intermediate_size`` (moe_shared_ffn_hidden) scaled by ``sigmoid(w . x)``
(moe_shared_gate). There is no z-loss (an import sets ``moe_z_loss=0``). Refused: ``mlp_only_layers`` (dense layers
off the step pattern), sliding windows (``use_sliding_window``: Qwen2-MoE's own layer pattern is not built); on
export, what Qwen2-MoE cannot express (no gated shared expert, capacity, hard routing, sigmoid scores, groups, a
routed scale, a routing bias).

Tensor names: :mod:`.llama`'s for attention, norms, embeddings, head and dense MLPs; each MoE block's, per expert
(the layout of the published checkpoints, which transformers 5 writes too; its fused in-memory layout
``mlp.experts.gate_up_proj`` / ``down_proj`` is read as well)::

    model.layers.{i}.mlp.gate.weight                       layers.{i}.mlp.router.weight
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight  layers.{i}.mlp.experts.{gate,up,down}_proj.weight[j]
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight  layers.{i}.mlp.shared.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.shared_expert_gate.weight          layers.{i}.mlp.shared_gate.weight
"""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ConfigError
from ..config import ModelConfig
from ..hf_names import Entry
from ..rope import rope_fields_from_hf
from ..routers import has_bias
from .base import llama_keys, llama_names, llama_shape, merged, refuse, require_biases

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"
DEFAULTS = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=None,
    hidden_act="silu",
    max_position_embeddings=32768,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    use_sliding_window=False,
    decoder_sparse_step=1,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    num_experts_per_tok=4,
    num_experts=60,
    norm_topk_prob=False,
    router_aux_loss_coef=0.001,
    mlp_only_layers=None,
    qkv_bias=True,
)


def moe_fields(c: dict, source: str) -> dict:
    """The routing fields of a Qwen MoE ``config.json`` (``c``: merged with its defaults)."""
    if c.get("mlp_only_layers"):
        raise refuse(source, f"mlp_only_layers={c['mlp_only_layers']} (only decoder_sparse_step's pattern is built)")
    if c.get("use_sliding_window"):
        raise refuse(source, "use_sliding_window=true (the Qwen MoE window patterns are not built)")
    return dict(
        moe_experts=c.get("num_local_experts") or c["num_experts"],  # transformers 5 writes Qwen3-MoE's so
        moe_top_k=c["num_experts_per_tok"],
        moe_every=c["decoder_sparse_step"],
        moe_ffn_hidden=c["moe_intermediate_size"],
        moe_norm_topk=bool(c["norm_topk_prob"]),
        moe_capacity_factor=0.0,
        moe_aux_loss=float(c["router_aux_loss_coef"]),
        moe_z_loss=0.0,
    )


def moe_keys(cfg: ModelConfig) -> dict:
    """The routing keys of a Qwen MoE ``config.json`` for ``cfg`` (checked by :func:`check_moe`)."""
    return dict(
        num_experts=cfg.moe_experts,
        num_experts_per_tok=cfg.moe_top_k,
        decoder_sparse_step=cfg.moe_every,
        moe_intermediate_size=cfg.moe_ffn_dim,
        norm_topk_prob=cfg.moe_top_k > 1 if cfg.moe_norm_topk is None else cfg.moe_norm_topk,
        router_aux_loss_coef=cfg.moe_aux_loss,
        mlp_only_layers=[],
        use_sliding_window=False,
        output_router_logits=False,
    )


def check_moe(cfg: ModelConfig, family: str) -> None:
    """ConfigError unless ``cfg``'s experts and routing are a Qwen MoE's (softmax top-k, dropless, no bias)."""
    if cfg.flavor != "llama" or cfg.attention != "mha" or not cfg.moe_experts:
        raise ConfigError(f"model.family={family} needs a llama-flavour mixture of experts; unset model.family")
    off = [
        ("moe_router", "learned", cfg.moe_router),
        ("moe_router_score", "softmax", cfg.moe_router_score),
        ("moe_groups", 1, cfg.moe_groups),
        ("moe_routed_scale", 1.0, cfg.moe_routed_scale),
        ("moe_bias_rate", 0.0, cfg.moe_bias_rate),
        ("moe_capacity_factor", 0.0, cfg.moe_capacity_factor),
        ("sliding_window", None, cfg.sliding_window),
    ]
    for key, want, got in off:
        if got != want:
            raise ConfigError(f"{family} has no model.{key}={got}; set model.{key}={want} to export to Hugging Face")


def experts(cfg: ModelConfig, found: Collection[str], shared: str = "shared_expert"):
    """``moe_entries`` for :func:`~.base.llama_names`: the router (and its ``e_score_correction_bias`` where the
    routers carry one), the routed experts per expert (or fused, when ``found`` holds transformers 5's in-memory
    names) and, with them, the shared experts under ``mlp.<shared>`` and their gate."""
    fused = bool(cfg.moe_layers) and f"model.layers.{cfg.moe_layers[0]}.mlp.experts.gate_up_proj" in found
    router_bias = has_bias(cfg)

    def entries(i: int, hf: str, us: str) -> list[Entry]:
        ex = f"{us}mlp.experts."
        out = [Entry(hf + "mlp.gate.weight", (us + "mlp.router.weight",))]
        if router_bias:
            bias = "e_score_correction_bias"
            out.append(Entry(f"{hf}mlp.gate.{bias}", (f"{us}mlp.router.{bias}",)))
        if fused:
            out += [
                Entry(hf + "mlp.experts.gate_up_proj", (ex + "gate_proj.weight", ex + "up_proj.weight"), "cat1"),
                Entry(hf + "mlp.experts.down_proj", (ex + "down_proj.weight",)),
            ]
        else:
            out += [
                Entry(f"{hf}mlp.experts.{j}.{p}_proj.weight", (f"{ex}{p}_proj.weight",), "expert", j)
                for j in range(cfg.moe_experts)
                for p in ("gate", "up", "down")
            ]
        if cfg.moe_shared_experts:
            out += [
                Entry(f"{hf}mlp.{shared}.{p}_proj.weight", (f"{us}mlp.shared.{p}_proj.weight",))
                for p in ("gate", "up", "down")
            ]
        if cfg.moe_shared_gate:
            out.append(Entry(hf + "mlp.shared_expert_gate.weight", (us + "mlp.shared_gate.weight",)))
        return out

    return entries


def from_hf(raw: dict, source: str) -> ModelConfig:
    c = merged(DEFAULTS, raw)
    if not c["shared_expert_intermediate_size"]:
        raise refuse(source, "shared_expert_intermediate_size=0 (a shared expert of no width)")
    return llama_shape(
        c,
        source,
        MODEL_TYPE,
        qkv_bias=bool(c["qkv_bias"]),
        o_bias=False,
        mlp_bias=False,
        moe_shared_experts=1,
        moe_shared_ffn_hidden=c["shared_expert_intermediate_size"],
        moe_shared_gate=True,
        **moe_fields(c, source),
        **rope_fields_from_hf(raw, source),
    )


def picks(cfg: ModelConfig) -> bool:
    """Qwen2-MoE writes a mixture of experts with a gated shared expert."""
    return bool(cfg.moe_experts) and cfg.moe_shared_gate


def to_hf(cfg: ModelConfig) -> dict:
    check_moe(cfg, MODEL_TYPE)
    if cfg.moe_shared_experts != 1 or not cfg.moe_shared_gate:
        raise ConfigError(
            "Qwen2-MoE has one shared expert behind a sigmoid gate; set model.moe_shared_experts=1 and "
            "model.moe_shared_gate=true to export to Hugging Face"
        )
    qkv = cfg.bias("qkv")
    require_biases(cfg, "Qwen2-MoE", qkv, False, False, "Qwen2-MoE has a bias on q, k, v only (qkv_bias)")
    return dict(
        **llama_keys(cfg, MODEL_TYPE, ARCHITECTURE, cfg.ffn_dim),
        **moe_keys(cfg),
        shared_expert_intermediate_size=cfg.moe_shared_ffn_hidden or cfg.moe_ffn_dim,
        qkv_bias=qkv,
    )


def weight_map(cfg: ModelConfig, found: Collection[str] = ()) -> list[Entry]:
    return llama_names(cfg, experts(cfg, found))
