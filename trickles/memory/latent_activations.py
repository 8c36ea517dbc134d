"""What a multi-head latent attention layer (:mod:`trickles.models.mla`, ``model.attention = "mla"``) keeps for
backward, in place of the multi-head attention terms of :mod:`trickles.memory.activations`.

With ``s`` the tokens of a micro-batch on this rank (``B`` sequences of ``t = T / cp`` tokens; all ``s`` under tensor
parallelism, whose region entry gathers them under sequence parallelism), ``H`` the heads of this rank (``H / tp``),
per-head sizes ``n = qk_nope_head_dim``, ``r = qk_rope_head_dim``, ``v = v_head_dim``, ``k = n + r``, the latent ranks
``L = kv_lora_rank`` and ``Q = q_lora_rank``, ``p`` bytes per element of the compute type. The attention norm's
output (kept by ``q_proj`` or ``q_a_proj`` and ``kv_a_proj_with_mqa`` alike, one storage, the sequence shard under
sequence parallelism) is counted with the norms, as for multi-head attention:

==========================  ============================================================  ===========================
piece                       saved for backward                                            bytes
==========================  ============================================================  ===========================
query latent (``Q`` set)    ``q_a_proj``'s output (the norm's input), fp32 ``1/rms``, the  ``2 p s Q + 4 s``
                            normed latent ``q_b_proj`` keeps (replicated over tp)
key/value latent            ``kv_a_proj_with_mqa``'s whole output ``[c, k_rot]`` (the norm  ``p s (2 L + r) + 4 s``
                            reads a view of it), fp32 ``1/rms``, the normed ``c``
                            ``kv_b_proj`` keeps (replicated over tp)
rotary casts                below fp32, cos and sin cast for ``q_rot`` and ``k_rot``        ``4 p t r`` (documents:
                                                                                          ``4 p s r``)
core, fused                 ``k == v`` (and CPU without dropout): q and k (concatenated),   ``p s H (2k + n + v)``
                            ``kv_b_proj``'s output (v is a view of it), the output, fp32    ``+ p s H v + 4 s H``
                            log-sum-exp
core, math path             ``k != v`` or dropout on a CPU: SDPA's math path in fp32 --     ``4 s H (2k + v)
                            q (scaled), k, v, the probabilities (with dropout: their mask   + 4 (12) B H T^2 + p s H v``
                            and the dropped ones) -- and ``o_proj``'s copy of the output
==========================  ============================================================  ===========================

**Context parallelism.** The ring (:mod:`trickles.parallel.ring`) pads v with zeros to ``k`` and runs the fused
kernel on each block: it keeps q, k (concatenated), the padded v and its padded output, ``p s H k`` each, the fp32
log-sum-exp ``4 s H``, and ``o_proj`` a copy of the cut output, ``p s H v`` (``v = k``: ``kv_b_proj``'s output in
place of the padded v, and ``o_proj`` a view of the ring's output). The all-to-all mode runs the one-process
core on whole sequences for ``H / cp`` heads (``B H T^2 / cp`` scores); its all-to-alls keep nothing, and in the fused
case its received ``v`` (``p s H v``) replaces ``kv_b_proj``'s output and the head-sharded output sits beside
``o_proj``'s input (``+ p s H v``).

**Packed documents**: on one process and in the all-to-all mode the fused kernel keeps the boolean mask in the compute
type, ``p B T^2`` (the math path adds it to the scores: nothing kept; the ring's block masks are not saved tensors);
the per-row rotary tables as for multi-head attention (:mod:`trickles.memory.activations`, of size ``r``).

**Recomputation.** ``selective`` recomputes the core: the checkpoint keeps its inputs, q, k and ``kv_b_proj``'s
output, ``p s H (2k + n + v)``, and ``o_proj`` its input, ``p s H v``; ``full`` keeps the block input only.

Measured to the byte against the saved-tensor meter on a CPU (``tests/unit/test_memory_mla.py``,
``tests/distributed/test_memory_mla_ranks.py``): one process in every recomputation mode, fp32 and bf16, with and
without ``Q``, the fused kernel and the math path, packed documents, dropout; tp2 with and without sequence
parallelism, the cp2 ring and all-to-all (with packed documents). CUDA's kernels are not measured: the fused formula
is their estimate there, with or without dropout (:func:`latent_exact`; the report says so).
"""

from __future__ import annotations

from ..models.config import ModelConfig


def latent_attention_bytes(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    p: int,
    tp: int = 1,
    cp: int = 1,
    cp_mode: str = "ring",
    documents: bool = False,
    device_type: str = "cpu",
) -> tuple[int, int, int]:
    """``(attention, core, -kept)``: the bytes one latent attention layer keeps beyond the attention norm's output
    (module docstring), for ``batch`` sequences of ``seq`` tokens on this rank (``seq`` its ``T / cp``); of them the
    core's own, which ``selective`` recomputation drops; less what its checkpoint keeps in their place."""
    s, whole = batch * seq, seq * cp
    heads = cfg.n_heads // tp
    n, r, v, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    k = n + r
    latents = p * s * (2 * rank + r) + 4 * s
    if cfg.q_lora_rank is not None:
        latents += 2 * p * s * cfg.q_lora_rank + 4 * s
    if p != 4:  # cos and sin cast for q_rot and k_rot (per row with packed documents)
        latents += 4 * p * (s if documents else seq) * r
    ulysses = cp > 1 and cp_mode == "ulysses"
    out = p * s * heads * v  # o_proj's input
    dropout = cfg.dropout > 0
    if cp > 1 and not ulysses:  # the ring: q, k, v (padded, else kv_b_proj's output), its output, log-sum-exp
        values = k if v != k else n + v
        core = p * s * heads * (3 * k + values) + 4 * s * heads + (out if v != k else 0)
    elif device_type != "cuda" and (v != k or dropout):  # SDPA's math path, fp32, on whole sequences
        scores = batch * heads * whole * whole // cp
        core = 4 * s * heads * (2 * k + v) + (12 if dropout else 4) * scores + out
    else:  # the fused kernel (all-to-all: on whole sequences, its v received, its output in head shards beside)
        core = p * s * heads * (2 * k + (v if ulysses else n + v)) + out + 4 * s * heads + (out if ulysses else 0)
        if documents and not (cp > 1 and not ulysses):
            core += p * batch * whole * whole
    kept = p * s * heads * (2 * k + n + v) + out  # what selective recomputation keeps of the core
    return latents + core, core, -kept


def latent_exact(device_type: str) -> bool:
    """Whether :func:`latent_attention_bytes` is measured exact on ``device_type`` (module docstring)."""
    return device_type != "cuda"


def latent_notes(cfg: ModelConfig, device_type: str) -> list[str]:
    """The report's line on latent attention's activations where they are an estimate (CUDA's kernels), else none."""
    if cfg.attention != "mla" or latent_exact(device_type):
        return []
    return [
        "latent attention: its activations on CUDA assume a fused kernel keeping q, k, v, the output and the "
        "log-sum-exp (measured exact on CPU only; trickles.memory.latent_activations)"
    ]
