"""What each tensor-parallel mode costs a rank: bytes sent and parameters held -- stated once.

Pure functions of a :class:`~trickles.models.config.ModelConfig`, a :class:`~.layout.Layout` (the mode, ``tp``, and
for a grid its ``q`` and depth ``d``), the micro-batch ``B``, the sequence ``T`` and ``p`` bytes per element of the
compute type. The memory report (:mod:`trickles.memory.report`, :mod:`trickles.memory.tp_modes`) and the tests read
them; the ledger (:class:`~trickles.comm.CommLedger`) is tested equal to them, byte for byte. What a rank saves for
backward is :mod:`trickles.parallel.tensor.activation_costs`'.

Notation: ``N = B T`` tokens of a micro-batch; ``d`` model width, ``a``/``a_kv`` query/key-value heads of size ``h``,
``f`` MLP width, ``V`` vocabulary, ``L`` blocks. A grid rank holds ``n`` tokens of the residual stream and ``d/q`` of
its features (:class:`~trickles.parallel.tensor.grid_model.GridContext`): ``n = N/q`` (2-D), ``N/(q d)`` (2.5-D),
``N/q^2`` (3-D). Collectives over ``k`` ranks of ``S`` bytes send (per rank, rounded per call as the ledger does)
``AR = 2 (k-1)/k S``, ``AG = (k-1) S`` (``S`` the shard), ``RS = (k-1)/k S``.

**Communication** (:func:`comm_bytes`), per micro-batch, forward / backward:

* 1-D (Megatron): a block all-reduces its ``[N, d]`` activation twice each way, ``4 AR(p N d)`` (with a full-width
  q/k norm, :class:`~trickles.parallel.tensor.layers.SplitWidthRMSNorm`, also its two ``[N]`` fp32 sums of squares
  each way, ``4 AR(4 N)``); the model adds the
  embedding's exit (forward) and the final norm's entry (backward), and the loss's three ``[N]`` fp32 all-reduces.
  Sequence parallelism turns each all-reduce into a reduce-scatter + all-gather of the same volume and gathers
  each region's input again in backward (``2 L + 1`` more ``AG(p N d / tp)``).
* a grid's linear ``h -> h'``: :func:`~trickles.parallel.tensor.grid_linear.summa_bytes` (2-D, 2.5-D),
  :func:`~trickles.parallel.tensor.grid_linear.cube_bytes` (3-D);
* a grid's norm (:class:`~trickles.parallel.tensor.grid_model.GridNorm`): forward ``AR(4n)`` over the hidden group
  (LayerNorm two), backward ``AR(4n)`` (LayerNorm ``AR(8n)``), and its weight's (and bias's) gradient
  ``AR(p d/q)`` over each token group (2-D: the column; 2.5-D: column and depth; 3-D: column and row);
* a block: two norms and its linears (q, k, v, o, gate, up, down; fused: qkv, gate_up); attention is local;
* the model: embedding -- 2-D/2.5-D ``AG(p V d/q^2)`` over the column forward, ``RS(p V d/q)`` backward (2.5-D
  also ``AR(p V d/q^2)`` over the depth), tied: a swap of the block with rank ``(j, i)``, ``p V d/q^2`` sent each
  way off the diagonal; 3-D: ``AG(p V d/q^3)`` / ``RS(p V d/q^2)`` over the column and ``RS(p N d/q^2)`` /
  ``AG(p N d/q^3)`` over the row -- learned positions (``AR(p T_max d/q)`` over each token group, backward), the
  final norm, the output layer ``d -> V`` and the loss: three ``AR(4n)`` over the row, and two ``AR(4)`` over
  each of the logits' token groups (the token count, the loss);
* full recomputation runs each block's forward again in backward (:func:`comm_bytes`);
* a step adds the gradient norm's ``AR(4)`` over ``tp`` (1-D: and one all-reduce of the gradients every rank
  holds but computes from other data, :func:`partial_grad_count`).

**Parameters** (:func:`param_count`) a rank holds: a grid splits every matrix ``q^2`` ways (3-D ``q^3``; 2.5-D
replicates it over the depth), every vector (norms, biases) and the positions ``q`` ways; the embedding is
``V d/q^2`` (3-D ``V d/q^3``). 1-D: matrices and the vocabulary ``tp`` ways, norms, row-parallel biases and
positions whole, key/value projections whole when ``tp`` does not divide ``a_kv``; a block's norms as
``model.norm_placement`` places them (:func:`~.layout.block_norms`) and its q/k norms' weights
(:func:`~.layout.qk_norm_elements`: per head whole, full width split with the heads).
"""

from __future__ import annotations

from ...comm import wire_bytes
from ...models.config import ModelConfig
from ...models.mla_config import latent_params
from .grid_linear import cube_bytes, summa_bytes
from .layout import ROW_PARALLEL, Layout, block_linears, block_norms, qk_norm_elements
from .region_bytes import partial_grad_elements

# ---- collectives, as the ledger counts them (one call each: :func:`trickles.comm.wire_bytes`, rounded) ----------


def all_reduce(k: int, nbytes: float) -> int:
    return int(round(wire_bytes("all_reduce", nbytes, k)))


def all_gather(k: int, shard_bytes: float) -> int:
    return int(round(wire_bytes("all_gather", shard_bytes, k)))


def reduce_scatter(k: int, nbytes: float) -> int:
    return int(round(wire_bytes("reduce_scatter", nbytes, k)))


def _fb(forward: float = 0, backward: float = 0) -> dict[str, int]:
    return {"forward": int(forward), "backward": int(backward)}


def _add(*parts: dict[str, int]) -> dict[str, int]:
    return _fb(sum(x["forward"] for x in parts), sum(x["backward"] for x in parts))


# ---- communication ---------------------------------------------------------------------------


def linear_comm(lay: Layout, batch: int, seq: int, h: int, h2: int, bias: bool, p: int) -> dict[str, int]:
    """A grid's linear ``h -> h'`` on a micro-batch: the layer's own formula
    (:mod:`~trickles.parallel.tensor.grid_linear`)."""
    if lay.mode == "3d":
        out = cube_bytes(lay.q, batch * seq, h, h2, bias, p)
    else:
        out = summa_bytes(lay.q, lay.depth, batch * seq // (lay.q * lay.depth), h, h2, bias, p)
    return _fb(out["forward"], out["backward"])


def norm_comm(cfg: ModelConfig, lay: Layout, n: int, p: int) -> dict[str, int]:
    """A :class:`~trickles.parallel.tensor.grid_model.GridNorm` over ``n`` tokens (module docstring)."""
    q, ln = lay.q, cfg.flavor == "gpt2"
    stats = all_reduce(q, 4 * n)
    weights = sum(all_reduce(k, p * (cfg.d_model // q)) for k in lay.token_groups) * (2 if ln else 1)
    return _fb(stats * (2 if ln else 1), all_reduce(q, (8 if ln else 4) * n) + weights)


def block_comm(cfg: ModelConfig, lay: Layout, batch: int, seq: int, p: int) -> dict[str, int]:
    """Bytes one rank sends in one dense block's forward and backward, for a micro-batch of ``batch x seq``."""
    if not lay.grid:
        act = p * batch * seq * cfg.d_model
        width = 2 * all_reduce(lay.tp, 4 * batch * seq) if cfg.qk_norm == "full" else 0  # q/k sums of squares
        if not lay.sequence_parallel:
            return _fb(2 * all_reduce(lay.tp, act) + width, 2 * all_reduce(lay.tp, act) + width)
        pair = reduce_scatter(lay.tp, act) + all_gather(lay.tp, act / lay.tp)
        return _fb(2 * pair + width, 2 * pair + 2 * all_gather(lay.tp, act / lay.tp) + width)  # backward: regathers
    norms = norm_comm(cfg, lay, lay.tokens(batch, seq), p)
    return _add(norms, norms, *(linear_comm(lay, batch, seq, h, h2, b, p) for _, h, h2, b in block_linears(cfg)))


def head_comm(
    cfg: ModelConfig, lay: Layout, batch: int, seq: int, p: int, tp_rank: int | None = None
) -> dict[str, int]:
    """Everything of a micro-batch's forward and backward besides the blocks: embedding, positions, final norm,
    output layer and loss (module docstring). ``tp_rank``: a tied 2-D/2.5-D embedding's diagonal ranks swap
    nothing; None: an off-diagonal rank's (the most)."""
    d, v, n_all = cfg.d_model, cfg.vocab_size, batch * seq
    if not lay.grid:
        t, act = lay.tp, p * n_all * d
        ce = _fb(3 * all_reduce(t, 4 * n_all))
        if not lay.sequence_parallel:  # embedding exit, final norm entry
            return _add(_fb(all_reduce(t, act), all_reduce(t, act)), ce)
        gathered = all_gather(t, act / t)  # the final norm's entry gathers, the output layer's regathers
        return _add(_fb(reduce_scatter(t, act) + gathered, reduce_scatter(t, act) + 2 * gathered), ce)
    q, n = lay.q, lay.tokens(batch, seq)
    if lay.mode == "3d":
        table = _fb(all_gather(q, p * v * d // q**3), reduce_scatter(q, p * v * d // q**2))
        rows = _fb(reduce_scatter(q, p * n_all * d // q**2), all_gather(q, p * n_all * d // q**3))
        embed = _add(table, rows)
    else:
        embed = _fb(
            all_gather(q, p * v * d // q**2),
            reduce_scatter(q, p * v * d // q) + all_reduce(lay.depth, p * v * d // q**2),
        )
        if cfg.tied:
            i, j = (None, None) if tp_rank is None else ((tp_rank // q) % q, tp_rank % q)
            swap = 0 if i is not None and i == j else p * v * d // q**2
            embed = _add(embed, _fb(swap, swap))
    positions = (
        _fb(0, sum(all_reduce(k, p * cfg.max_seq_len * d // q) for k in lay.token_groups))
        if cfg.flavor == "gpt2"
        else _fb()
    )
    output = linear_comm(lay, batch, seq, d, v, False, p)
    logit_groups = [q, q] if lay.mode == "3d" else lay.token_groups
    loss = _fb(3 * all_reduce(q, 4 * n) + 2 * sum(all_reduce(k, 4) for k in logit_groups))
    return _add(embed, positions, norm_comm(cfg, lay, n, p), output, loss)


def comm_bytes(
    cfg: ModelConfig,
    lay: Layout,
    batch: int,
    seq: int,
    p: int,
    recompute: str = "none",
    tp_rank: int | None = None,
    whole: int | None = None,
) -> dict:
    """``{"block": {"forward", "backward"}, "head": {...}, "forward", "backward", "total"}``: bytes one rank sends for
    one micro-batch. ``recompute="full"`` runs each block's forward again in backward, up to the last tensor it
    saves (torch's checkpoint stops there): 1-D leaves out the MLP's exit (all-reduce or reduce-scatter), and under
    sequence parallelism the recomputed blocks keep their gathered inputs (no regathers); a grid's last linear
    saves its gathered input, so its whole forward runs again. ``whole``: how many blocks are recomputed so
    (``memory.recompute_num_layers``; default all under ``full``); ``"block"`` is then a block not recomputed."""
    block, head = block_comm(cfg, lay, batch, seq, p), head_comm(cfg, lay, batch, seq, p, tp_rank)
    L = cfg.n_layers
    whole = (L if recompute == "full" else 0) if whole is None else whole
    again = 0  # what a block recomputed whole sends beyond a plain one
    if whole:
        again = block["forward"]
        if not lay.grid:
            act = p * batch * seq * cfg.d_model
            again -= reduce_scatter(lay.tp, act) if lay.sequence_parallel else all_reduce(lay.tp, act)
            if lay.sequence_parallel:
                again -= 2 * all_gather(lay.tp, act / lay.tp)  # its entries keep their gathered inputs: no regathers
                if whole == L:
                    block = _fb(block["forward"], block["backward"] - 2 * all_gather(lay.tp, act / lay.tp))
                    again += 2 * all_gather(lay.tp, act / lay.tp)
    fwd, bwd = L * block["forward"] + head["forward"], L * block["backward"] + whole * again + head["backward"]
    return {"block": block, "head": head, "forward": fwd, "backward": bwd, "total": fwd + bwd}


def partial_grad_count(cfg: ModelConfig, lay: Layout) -> int:
    """1-D: gradient elements every tp rank holds but computes from other data, summed over ``tp`` once a step
    (:func:`~.region_bytes.partial_grad_elements`: replicated key/value projections and their biases; under sequence
    parallelism the norms, gpt2's positions and the row-parallel linears' biases, added to sequence shards)."""
    if lay.grid or lay.tp == 1:
        return 0
    return partial_grad_elements(cfg, lay.tp, lay.sequence_parallel)


def step_comm(
    cfg: ModelConfig,
    lay: Layout,
    batch: int,
    seq: int,
    p: int,
    micro_batches: int = 1,
    recompute: str = "none",
    grad_bytes: int = 4,
    tp_rank: int | None = None,
    whole: int | None = None,
) -> int:
    """Bytes one rank sends over its tensor-parallel groups in one training step of ``micro_batches`` micro-batches:
    their forwards and backwards, the gradient norm's fp32 all-reduce over ``tp`` (AdamW's clipping) and, 1-D, the
    partial gradients' all-reduce (``grad_bytes`` per element)."""
    per_micro = comm_bytes(cfg, lay, batch, seq, p, recompute, tp_rank, whole)["total"]
    return (
        micro_batches * per_micro
        + all_reduce(lay.tp, 4)
        + all_reduce(lay.tp, grad_bytes * partial_grad_count(cfg, lay))
    )


# ---- parameters ------------------------------------------------------------------------------


def param_count(cfg: ModelConfig, lay: Layout) -> dict[str, int]:
    """``{"block": elements of one dense block a rank holds, "rest": embedding, positions, final norm, output,
    "total": ...}`` (module docstring)."""
    d, v, L = cfg.d_model, cfg.vocab_size, cfg.n_layers
    norm = d * (2 if cfg.flavor == "gpt2" else 1)
    positions = cfg.max_seq_len * d if cfg.flavor == "gpt2" else 0
    if not lay.grid:
        t = lay.tp
        block = block_norms(cfg) * norm + qk_norm_elements(cfg, t)[0]
        if cfg.attention == "mla":  # heads split, the compressions whole (:mod:`.latent`)
            split, whole = latent_params(cfg)
            block += split // t + whole
        for name, h, h2, b in block_linears(cfg):
            if cfg.attention == "mla" and name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                continue  # (counted above)
            whole = name in ("k_proj", "v_proj") and cfg.kv_heads % t != 0  # replicated key/value heads
            row = name in ROW_PARALLEL  # row-parallel: the bias is whole
            block += h * h2 // (1 if whole else t) + (h2 // (1 if whole or row else t) if b else 0)
        rest = norm + positions + v * d // t * (1 if cfg.tied else 2)
    else:
        q = lay.q
        mat = q**3 if lay.mode == "3d" else q * q
        block = block_norms(cfg) * norm // q + sum(
            h * h2 // mat + (h2 // q if b else 0) for _, h, h2, b in block_linears(cfg)
        )
        rest = norm // q + positions // q + v * d // mat * (1 if cfg.tied else 2)
    return {"block": block, "rest": rest, "total": L * block + rest}
