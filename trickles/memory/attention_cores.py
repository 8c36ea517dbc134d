"""What a layer's attention core keeps beyond the fused kernel's ``q, k, v``, output and log-sum-exp, by layer: a
sliding window's mask, and the explicit path of soft-capped scores.

With ``B`` sequences of ``T`` tokens in the core on one rank (``s = B T``), ``a`` and ``a_kv`` query and key/value
heads of size ``h`` in the core, ``r = a / a_kv``, ``p`` bytes per element of the compute type:

* **sliding window** (:func:`~trickles.models.masks.layer_window` ``w < T``): SDPA gets a boolean band mask and keeps
  it converted to the compute type, ``[1, 1, r T, T]`` (the ``r`` query heads of a key/value head attend as ``r T``
  rows of it; ``r = 1``: ``[1, 1, T, T]``), ``p r T^2``; with ``r > 1`` its output comes back ``[B, a_kv, r T, h]``,
  which ``o_proj`` cannot read as ``[B, T, a h]`` without a copy: ``+ p s a h`` (where ``o_proj`` would otherwise
  keep the core's output itself: one process, 1-D tensor parallelism).
* **soft-capped scores** (``model.attn_softcap``, every layer): the explicit path
  (:func:`~trickles.models.masks.capped_attention`) keeps in place of the log-sum-exp (``- 4 s a``) the ``tanh``
  output (``p`` a score), the fp32 probabilities and, below fp32, their cast to the compute type (``p``) --
  ``(4 + p [+ p]) B a T^2`` -- and the inverted boolean band its ``masked_fill`` keeps, ``T^2``; its grouped copy of
  the queries takes q's place. Its output is kept by nobody but ``o_proj``: where that keeps a copy of its own (the
  all-to-all context parallelism, whose core sees whole sequences on ``a / cp`` heads; a 2-D/2.5-D/3-D grid, which
  gathers it), the fused kernel's output counted there goes too, ``- p s a h``. A window there is only a different
  mask: no more bytes.

``selective`` recomputation drops these with the rest of the core (the checkpoint keeps ``q, k, v``), ``full`` keeps
the block input only; elementwise recomputation leaves them. Ring attention and packed documents attend through their
own paths, which keep what the fused kernel keeps. :func:`core_bytes` is measured to the byte against the saved-tensor
meter (the tests).
"""

from __future__ import annotations

from ..models.config import ModelConfig
from ..models.masks import layer_window


def core_bytes(
    cfg: ModelConfig, layer: int, batch: int, seq: int, heads: int, kv_heads: int, p: int, output_kept: bool = True
) -> int:
    """Bytes layer ``layer``'s attention core keeps beyond the fused kernel's (module docstring), for ``batch``
    sequences of ``seq`` tokens in the core with ``heads`` query and ``kv_heads`` key/value heads, ``p`` bytes an
    element; ``output_kept``: ``o_proj`` keeps the core's output itself (one process, 1-D tensor parallelism), not a
    copy of its own. All of it is dropped by selective recomputation."""
    if cfg.attn_softcap is not None:
        scores = batch * heads * seq * seq
        kept = (4 + p + (p if p != 4 else 0)) * scores + seq * seq - 4 * batch * seq * heads
        return kept - (0 if output_kept else p * batch * seq * heads * cfg.head_dim)
    window = layer_window(cfg, layer)
    if window is None or window >= seq:
        return 0
    rep = heads // kv_heads
    kept = p * rep * seq * seq
    if rep > 1 and output_kept:
        kept += p * batch * seq * heads * cfg.head_dim
    return kept
