"""The activations the multi-token prediction modules keep (``model.mtp_depth``, :mod:`trickles.models.mtp`): part of
the head's (:func:`~trickles.memory.activations.activation_bytes`), on a pipeline's last stage.

Per depth ``k``, for ``s = B T`` tokens (``sn`` under sequence parallelism), ``p`` bytes per element and a norm that
keeps ``norm`` bytes with the linear after it (``norm - p sn d``: its input and statistics)::

    embedding ids (int64; tp: and the out-of-range mask)      8 s  (tp: 9 s)  + gpt2's positions 8 s + dropout mask
    the previous representation's norm (its input is kept)    norm - 2 p sn d   (statistics only)
    enorm, hnorm: input and statistics each                   2 (norm - p sn d)
    eh_proj's input [sn, 2d]                                  2 p sn d
    the block (never recomputed)                              a dense or mixture-of-experts layer's bytes
    norm_k: input and statistics                              norm - p sn d
    the loss over the s_k = s - B k rows with a target        p s_k d (the output projection's input) + the
                                                              loss's own over s_k rows + s (the kept-row mask);
                                                              tp: over all s rows, the input p sn d (its shard)

Exact (the activation meter agrees to the byte) for the unfused loss on one tensor-parallel rank; with the fused or
vocabulary-parallel loss the loss's terms are the main head's, over ``s_k`` rows, and a block with a sliding window
leaves out its attention-core terms (:mod:`~trickles.memory.attention_cores`): an estimate there.
"""

from __future__ import annotations


def mtp_bytes(
    cfg,
    batch: int,
    seq: int,
    sn: int,
    p: int,
    tp: int,
    norm: int,
    branches: int,
    mlp: int,
    experts: int,
    mask: int = 0,
    fused: bool = False,
    fp16: bool = False,
) -> int:
    """The bytes the ``cfg.mtp_depth`` modules keep for a micro-batch of ``batch`` sequences of ``seq`` tokens on one
    rank (module docstring); ``branches``: a block's norms and attention, ``mlp``, ``experts``: its dense MLP's or
    experts' (never recomputed: the recomputation modes apply to the model's own blocks); ``mask``: bytes a dropout
    mask keeps per element (0 without dropout); ``fused``, ``fp16``: as :func:`loss_bytes`."""
    depth, n, d = cfg.mtp_depth, cfg.n_layers, cfg.d_model
    if not depth:
        return 0
    s = batch * seq
    every, first = cfg.moe_every, cfg.moe_first_dense
    moe = [bool(cfg.moe_experts) and i >= first and i % every == every - 1 for i in range(n, n + depth)]
    total = 0
    for k in range(1, depth + 1):
        rows = s - batch * k if tp == 1 else s  # one rank's loss keeps the rows with a target; tp: all of them
        total += (9 if tp > 1 else 8) * s + (0 if cfg.flavor == "llama" else 8 * s) + mask * sn * d
        total += norm - 2 * p * sn * d + 3 * (norm - p * sn * d) + 2 * p * sn * d
        drops = 3 if moe[k - 1] and cfg.moe_shared_experts else 2  # the residual branches' dropouts
        total += branches + (experts if moe[k - 1] else mlp) + drops * mask * sn * d
        total += loss_bytes(cfg, rows, p, tp, fused, fp16) + (p * rows * d + s if tp == 1 else p * sn * d)
    return total


def loss_bytes(cfg, rows: int, p: int, tp: int, fused: bool = False, fp16: bool = False) -> int:
    """What a depth's loss keeps over ``rows`` rows beside its input: the main head's terms (``fused``: the chunked
    loss's input gradient and fp32 weight gradient; else the ids, the fp32 log-softmax over ``V / tp`` and the counts,
    the capped logits' tanh)."""
    v, d = cfg.vocab_size // tp, cfg.d_model
    ids = (9 if tp > 1 else 8) * rows
    if fused:
        return ids + (4 if fp16 else p) * rows * d + 4 * v * d - p * rows * d
    out = ids + 4 * rows * v + 4 + (8 if tp == 1 else 0)
    return out + (p * rows * v if cfg.final_softcap is not None else 0)
