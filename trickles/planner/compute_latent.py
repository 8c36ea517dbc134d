"""Multi-head latent attention's matrix products and parameters (:mod:`trickles.models.mla`, ``model.attention =
"mla"``), in place of the multi-head ones of :mod:`trickles.planner.compute` and :mod:`trickles.train.flops`.

With ``H`` heads, ``n = qk_nope_head_dim``, ``r = qk_rope_head_dim``, ``v = v_head_dim``, ``k = n + r``, the latent
ranks ``L = kv_lora_rank`` and ``Q = q_lora_rank``, width ``d``, on ``N`` tokens of a rank (1-D tensor parallelism over
``tp`` ranks: :mod:`trickles.parallel.tensor.latent`; a grid refuses latent attention):

==================  ===============================  ==========================================  ===================
linear              shape ``in -> out``              on a tensor-parallel rank                   FLOPs (forward)
==================  ===============================  ==========================================  ===================
``q_a_proj``        ``d -> Q``                       replicated: every rank, all ``N`` tokens    ``2 N d Q``
``q_b_proj``        ``Q -> H k``                     column-parallel                             ``2 N Q H k / tp``
(``q_proj``)        (``d -> H k``, without ``Q``)    column-parallel                             ``2 N d H k / tp``
``kv_a_proj...``    ``d -> L + r``                   replicated                                  ``2 N d (L + r)``
``kv_b_proj``       ``L -> H (n + v)``               column-parallel                             ``2 N L H (n+v) / tp``
``o_proj``          ``H v -> d``                     row-parallel                                ``2 N H v d / tp``
scores, values      ``q k^T`` over ``k``, ``P v``    the rank's ``H / tp`` heads                 ``2 B T^2 H (k + v)``
                                                                                                 ``/ tp`` (every score)
==================  ===============================  ==========================================  ===================

so a token's training FLOPs per layer are ``6`` times its weights' (``d Q + Q H k + d (L + r) + L H (n + v) + H v d``)
plus ``6 T H (k + v)`` for its scores and values (PaLM's convention: every score of a sequence of ``T``, forward and
twice that backward). Under tensor parallelism every rank repeats the replicated compressions: the ranks together
compute ``(tp - 1) 2 N d (Q + L + r)`` more than one process. Parameters: those matrices, the two latent norms'
weights ``Q + L`` and the biases of ``q_a_proj`` and ``kv_a_proj_with_mqa`` (``model.qkv_bias``: ``Q + L + r``) and
``o_proj`` (``d``); the compressions and their norms are held whole by every tensor-parallel rank, the rest split.
Tested against ``torch.utils.flop_counter.FlopCounterMode`` on a forward and the built model's count.
"""

from __future__ import annotations

from ..models.config import ModelConfig
from ..models.mla_config import latent_linears, latent_params

# the linears and parameters are the model's own count (:mod:`trickles.models.mla_config`), the products here
__all__ = ["latent_linears", "latent_matmul_params", "latent_params", "latent_score_width"]


def latent_matmul_params(cfg: ModelConfig) -> int:
    """The weights of one latent attention block's matrix products (module docstring)."""
    return sum(n_in * n_out for _, n_in, n_out, _ in latent_linears(cfg))


def latent_score_width(cfg: ModelConfig) -> tuple[int, int]:
    """``(k, v)``: the scores' head size (``n + r``) and the values' (``v``)."""
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
