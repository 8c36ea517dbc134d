"""Model FLOPs per token and device peaks, for achieved FLOP/s and MFU.

Training FLOPs per token (PaLM, appendix B): ``6 N + 12 L d T``, with ``N`` the parameters
taking part in matrix multiplies (attention and MLP projections and the output head; the
embedding lookup is free; of a mixture-of-experts block only the router and the experts a token
passes through) and ``12 L d T`` the attention scores and weighted sums over a
sequence of ``T`` (forward ``4 L d T``, backward twice that). Multi-head latent attention
(``model.attention=mla``) counts its own projections (:mod:`trickles.planner.compute_latent`) and, for its scores
over ``k = qk_nope + qk_rope_head_dim`` and values of ``v = v_head_dim`` on ``H`` heads, ``6 L T H (k + v)``.
MFU is achieved model FLOP/s over the devices' dense peak.

**LoRA** (``train.lora_rank > 0``): the base is frozen, so a run needs no weight gradient but the adapters'. Its MFU
counts the FLOPs the step needs, not ``6 N``: per token the forward ``2 N``, the frozen weights' input gradients
``2 (N - N_0)``, the adapters ``sum 6 r (in + out)`` (forward ``2 r (in + out)``; backward ``2 r out`` each for ``dx``
of ``B`` and ``dB``, ``2 r in`` each for ``dA`` and ``dx`` of ``A``) less ``2 r in`` for each adapter in ``A_0``, and
the attention core ``4 L d T`` forward plus ``8 d T`` backward for each of the ``L - L_0`` blocks whose q, k or v needs
a gradient. ``N_0``, ``A_0``, ``L_0``: the weights, adapters and attention cores before the first adapter, whose
inputs need no gradient since the embedding is frozen (the first block's q/k/v projections at least;
:mod:`trickles.planner.compute_lora`). A step of a LoRA run thus counts about ``4 N`` rather than ``6 N``: the
same step at the same speed shows a lower MFU than full training, the share of the device it actually used. The
count is the planner's (:func:`~trickles.planner.compute_lora.lora_chunk_work` on one sequence, every score), tested
against ``FlopCounterMode`` on a real LoRA step.
"""

from __future__ import annotations

import torch

from ..adapters.lora import LoRASettings
from ..models.config import ModelConfig
from ..planner.compute_latent import latent_matmul_params, latent_score_width
from ..planner.compute_lora import lora_chunk_work
from ..topology import ParallelDims

# Dense peak FLOP/s per device by (name fragment, precision); fp32 means TF32 tensor cores.
PEAKS = [
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12}),
    ("H800", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("A800", {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 183e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 60e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 62.5e12}),
]


def matmul_params(cfg: ModelConfig, active: bool = True) -> int:
    """Parameters in matrix multiplies. In a mixture-of-experts block a token passes the router and
    ``moe_top_k`` routed experts plus the shared ones: ``active`` counts those (what FLOPs and MFU
    use); ``active=False`` counts every expert."""
    d, L, hd = cfg.d_model, cfg.n_layers, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    if cfg.attention == "mla":
        attn = latent_matmul_params(cfg)
    per_mlp = (3 if cfg.flavor == "llama" else 2) * d
    mlp = per_mlp * cfg.ffn_dim
    experts = (cfg.moe_top_k if active else cfg.moe_experts) + cfg.moe_shared_experts
    moe = per_mlp * cfg.moe_ffn_dim * experts + d * cfg.moe_experts
    n_moe = len(cfg.moe_layers)
    return L * attn + (L - n_moe) * mlp + n_moe * moe + d * (cfg.vocab_size or 0)


def flops_per_token(cfg: ModelConfig, seq_len: int, lora: LoRASettings | None = None) -> float:
    """Training FLOPs (forward + backward) per token; with ``lora`` (``train.lora()``) a LoRA run's (module
    docstring)."""
    if lora is not None:
        work = lora_chunk_work(
            cfg, ParallelDims(), 1, seq_len, list(range(cfg.n_layers)), True, False, 4, lora, "materialized"
        )
        return (work.flops + work.backward_flops) / seq_len
    if cfg.attention == "mla":  # scores over k, values over v, on every head
        k, v = latent_score_width(cfg)
        return 6.0 * matmul_params(cfg) + 6.0 * cfg.n_layers * seq_len * cfg.n_heads * (k + v)
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak of one device at ``precision``, or None when unknown (e.g. a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAKS:
        if fragment in name:
            return peaks.get(precision)
    return None
