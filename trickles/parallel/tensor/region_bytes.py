"""What 1-D tensor parallelism (:mod:`trickles.parallel.tensor.layers`) sends and sums: stated once.

:func:`region_wire_bytes`: the collectives one rank's regions take for one micro-batch, per kind of collective
(calls, bytes, bytes on the wire as :func:`trickles.comm.wire_bytes` counts them); :func:`partial_grad_elements`:
the gradient elements every tensor-parallel rank completes with one all-reduce a step (``TPSpec.partial_grad``).
The ledger is tested equal to them (``tests/distributed/test_tensor_parallel.py``) and the planner's time model
reads them (:mod:`trickles.planner.traffic`). A tensor-parallel grid's formulas are
:mod:`trickles.parallel.tensor.costs`'.
"""

from __future__ import annotations

from ...comm import wire_bytes
from .layout import ROW_PARALLEL, bias_elements, block_norms, has_bias, qk_norm_elements


def region_wire_bytes(
    tokens: int,
    d: int,
    p: int,
    tp: int,
    sequence_parallel: bool,
    dense_layers: int,
    moe_layers: int = 0,
    embedding: bool = True,
    head: bool = True,
    recompute: str = "none",
    whole: int | None = None,
    width_norms: bool = False,
) -> dict[str, tuple[int, int, int]]:
    """``{op: (calls, bytes, wire bytes)}`` one rank's tensor-parallel collectives take for one micro-batch of
    ``tokens`` (of the whole sequence, ``B T``, or ``B T / cp``), model width ``d``, ``p`` bytes per element.

    Regions (one activation ``A = tokens d p`` each): a dense block has two (attention, MLP), a mixture-of-experts
    block one (its experts run outside any region); each region all-reduces ``A`` leaving in forward and entering in
    backward; the vocabulary-parallel embedding's exit (forward, on the first stage: ``embedding``) and the final
    norm's entry (backward, on the last: ``head``) add one each: ``n = 4 L_dense + 2 L_moe + [embedding] + [head]``
    all-reduces, ``2 (tp-1)/tp A`` on the wire each. The loss (``head``) all-reduces three ``[tokens]`` fp32 vectors
    (the logits' max, the target logit, the sum of exponentials).

    Sequence parallel: each all-reduce becomes a reduce-scatter of ``A`` plus an all-gather of ``A / tp``, the same
    wire volume, and each region's input (and the output layer's) is all-gathered once more in backward:
    ``2 L_dense + L_moe + [head]`` all-gathers (:class:`~.layers.TPContext`'s regather).

    ``recompute="full"`` reruns every block's forward in backward up to the last tensor it saves (torch's checkpoint
    stops there), so its collectives but the last region's exit: plain one all-reduce per block (the attention's exit);
    sequence parallel the entries' all-gathers and the attention's reduce-scatter, and the rerun keeps the gathered
    inputs, so the blocks' backward regathers go away (as many all-gathers as the rerun adds). ``whole``: how many of
    the blocks are recomputed so (``memory.recompute_num_layers``; default all under ``full``). (Selective and
    elementwise recomputation rerun no collective.) ``width_norms``: full-width q/k norms (``model.qk_norm=full``,
    :class:`~.layers.SplitWidthRMSNorm`) all-reduce their ``[tokens]`` fp32 sums of squares, q's and k's, in
    forward and in backward: 4 more all-reduces per block (and 2 per block its rerun runs again). Per step add
    :func:`partial_grad_elements`' all-reduce and the gradient norm's (4 bytes)."""
    if tp <= 1:
        return {}
    act = tokens * d * p
    regions = 2 * dense_layers + moe_layers
    n = 2 * regions + int(embedding) + int(head)
    rerun = dense_layers + moe_layers if recompute == "full" else 0  # exits run again: all but each block's last
    rerun = rerun if whole is None else whole

    def entry(op: str, calls: int, size: int) -> tuple[int, int, int]:
        return calls, calls * size, calls * int(round(wire_bytes(op, size, tp)))

    loss = [entry("all_reduce", 3, tokens * 4)] if head else []
    if width_norms:
        loss.append(entry("all_reduce", 4 * (dense_layers + moe_layers) + 2 * rerun, tokens * 4))
    if not sequence_parallel:
        parts = [entry("all_reduce", n + rerun, act), *loss]
        return {"all_reduce": tuple(map(sum, zip(*parts)))}
    gathers = n + regions + int(head)  # entries, the regions' backward regathers (or their rerun entries), the output's
    out = {
        "reduce_scatter": entry("reduce_scatter", n + rerun, act),
        "all_gather": entry("all_gather", gathers, act // tp),
    }
    if loss:
        out["all_reduce"] = tuple(map(sum, zip(*loss)))
    return out


def partial_grad_elements(
    cfg,
    tp: int,
    sequence_parallel: bool,
    layers: int | None = None,
    first: bool = True,
    last: bool = True,
    moe_elements: int = 0,
) -> int:
    """Gradient elements every tensor-parallel rank holds whole but computes from part of the data, summed over the
    group in one all-reduce per step (``TPSpec.partial_grad``): key/value projections kept whole
    (:class:`~.layers.ReplicatedKV`, when ``tp`` does not divide ``n_kv_heads``: ``2 a_kv h d`` per block, with
    their biases (``model.qkv_bias``) ``+ 2 a_kv h``) and, under sequence parallelism, what sees only the rank's
    positions: the norms (RMSNorm ``d``, LayerNorm ``2 d``; two per block, the final one on the ``last`` stage), the
    row-parallel linears' biases (``d`` each of ``o_proj``, ``down_proj`` that has one: gpt2 ``2 d`` per block),
    learned positions (gpt2, ``first`` stage: ``T_max d``) and the mixture-of-experts MLPs (``moe_elements``: their
    router and experts the rank holds). ``layers``: the blocks the rank holds (default all)."""
    if tp <= 1:
        return 0
    layers = cfg.n_layers if layers is None else layers
    d, hd, gpt2 = cfg.d_model, cfg.head_dim, cfg.flavor == "gpt2"
    n = layers * qk_norm_elements(cfg, tp)[1]
    if cfg.kv_heads % tp and not cfg.fuses_projections:
        n += layers * 2 * cfg.kv_heads * hd * (d + (1 if has_bias(cfg, "k_proj") else 0))
    if sequence_parallel:
        norm = 2 * d if gpt2 else d
        n += (
            layers * (block_norms(cfg) * norm + bias_elements(cfg, ROW_PARALLEL)) + (norm if last else 0) + moe_elements
        )
        if gpt2:
            n += cfg.max_seq_len * d if first else 0
    return n
