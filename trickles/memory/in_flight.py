"""Communication buffers a layer holds beyond its saved activations while it runs (one layer at a time): the
memory report's per-layer transients.

* ring attention (``parallel.cp_mode=ring``): the key/value block held and the one arriving, and in backward two
  fp32 gradient blocks, one sent on and one arriving (:func:`ring_blocks_in_flight`);
* expert parallelism (``parallel.ep > 1``): the rows one all-to-all sends and receives, ``2 p m d``, ``m`` the
  assignments of the rank's tokens, predicted for a balanced load (:func:`expert_rows_in_flight`).
"""

from __future__ import annotations

from ..models.config import ModelConfig
from .moe_activations import moe_assignments


def expert_rows_in_flight(cfg: ModelConfig, batch: int, tokens: int, seq: int, p: int, received: int = 0) -> int:
    """Expert parallelism's rows alive at once beyond the saved activations, in one MoE block (one at a time):
    ``2 p m d`` with ``m`` the assignments of the rank's ``batch x tokens`` routed tokens
    (:func:`~trickles.memory.moe_activations.moe_assignments`; balanced, each rank receiving what it sends). Forward,
    the first all-to-all holds the gathered rows sent and the rows received; the second the received rows (still
    referenced by the dispatch) and the outputs being sent back (those that arrive are saved). Backward, each
    all-to-all holds the gradient rows sent and those received: ``2 p m d`` in every case
    (:func:`~trickles.parallel.expert.expert_dispatch`). ``received``: the rows the rank's experts receive when
    more than it sends (the routing bound, :func:`~trickles.memory.moe_activations.received_bound`): the second
    all-to-all then holds ``2 p m_in d``, the largest."""
    return 2 * p * max(received, moe_assignments(cfg, batch, tokens, seq)) * cfg.d_model


def ring_blocks_in_flight(cfg: ModelConfig, tokens: int, p: int, tp: int = 1) -> int:
    """Ring attention's key/value blocks alive at once beyond the saved activations, for ``tokens`` of this
    rank (one layer at a time): in backward the block held and the one arriving (``2 x 2 s a_kv h p``)
    and two fp32 gradient blocks, the one being sent on and the one arriving (``2 x 2 s a_kv h 4``);
    forward holds only the two key/value blocks."""
    kv = cfg.kv_heads // tp if cfg.kv_heads % tp == 0 else cfg.n_heads // tp
    block = 2 * tokens * kv * cfg.head_dim
    return 2 * block * p + 2 * block * 4
