"""What one rank computes: its GEMMs (with their shapes), its attention, its memory-bound work, its parameters.

Everything is for one micro-batch of ``B`` sequences of ``T`` tokens on one rank, ``N = B T / cp`` of them local
(context parallelism splits the sequence), forward only; backward is twice the forward's GEMM FLOPs
(``dX`` and ``dW``, the same shapes transposed: :attr:`Gemm.dx`, :attr:`Gemm.dw`; a LoRA run's frozen base has no
``dW``, :mod:`trickles.planner.compute_lora`) and twice its memory-bound bytes.

**GEMMs** (``[M, K] x [K, N]``, ``2 M N K`` FLOPs) of a linear ``h -> h'`` on a rank, by tensor-parallel mode:
1-D column-parallel ``[N, h] x [h, h'/tp]``, row-parallel ``[N, h/tp] x [h/tp, h']`` (sequence parallelism
gathers the full ``N`` first); 2-D ``[N/q, h] x [h, h'/q]``; 2.5-D ``[N/(q d), h] x [h, h'/q]``; 3-D
``[N/q, h/q] x [h/q, h'/q]`` (:mod:`trickles.parallel.tensor.grid_linear`) -- in every mode ``1/tp`` of the layer's
``2 N h h'``. A block: q, k, v (or fused qkv), o; gate and up (or fused), down. A mixture-of-experts block
replaces the MLP: the router ``[N_r, d] x [d, E]``, the rank's ``E/ep`` experts on the ``m`` assignments it
receives (balanced: as many as it routes, :func:`~trickles.memory.moe_activations.moe_assignments`), shared experts
on all ``N_r`` routed tokens -- ``N_r = N`` on every tensor-parallel rank (the experts are whole there), ``N/tp``
with sequence parallelism. The output layer ``d -> V`` on the last stage.

**Attention core**: per local head ``4 (T/cp) T h_d`` FLOPs per sequence for every score (scores and weighted sum,
``4 h_d`` per (query, key) entry, as :func:`trickles.train.flops.flops_per_token` counts them), as GEMMs
``[T/cp, h_d] x [h_d, T]`` and ``[T/cp, T] x [T, h_d]`` -- the ring's queries against every key (its blocks and
merges timed as one by calibration); all-to-all context parallelism (``ulysses``) instead runs whole sequences for
``1/cp`` of the heads, ``[T, h_d] x [h_d, T]`` and ``[T, T] x [T, h_d]`` on ``a_l / cp`` heads, the same FLOPs. How
they run depends on the attention kernel (:data:`ATTENTION`):

* ``flash`` (trickles: ``scaled_dot_product_attention``'s fused kernels) computes only the entries the mask leaves
  (flash attention and the ring skip the blocks above the diagonal, and those wholly outside a sliding window) and
  never writes the ``[T/cp, T]`` scores to memory: ``4 h_d P(T, w)`` per head and sequence, over the ``cp`` ranks,
  with :func:`causal_pairs` ``P(T, w) = sum_{i<T} min(i + 1, w)`` the keys each query sees (a layer's window ``w``,
  :func:`~trickles.models.masks.layer_window`; ``w = T`` without): ``T (T + 1) / 2`` for plain causal attention,
  ``w (w + 1) / 2 + (T - w) w`` for ``w < T`` -- the GEMMs' ``count`` is the fraction ``P / T^2`` of them;
* ``materialized`` (an unfused attention, e.g. Megatron-LM before FlashAttention: ``baddbmm``, a fused
  scale-mask-softmax, dropout, ``bmm``) computes all of them, the mask applied afterwards, and moves the score
  matrix through memory: ``S = a_l (T/cp) T`` elements per sequence (``a_l`` local heads), forward
  ``S (4 p + [dropout] (2 p + 1))`` bytes -- the scores written (``p``), the softmax reading them and writing the
  probabilities (``2 p``), dropout reading those and writing its output and a one-byte mask (``2 p + 1``), the
  weighted sum reading them (``p``). This is ``Work.attention_bytes``, which selective recomputation reruns.

Soft-capped scores (``model.attn_softcap``) run trickles' explicit path
(:func:`~trickles.models.masks.capped_attention`) whatever the kernel: every score computed, as ``materialized``, and
moved through memory by its own passes -- written (``p``), scaled, divided by the cap, ``tanh``, multiplied back
(``2 p`` each), masked (``2 p + 1``), the fp32 softmax (``p + 4``; below fp32 its cast, ``4 + p``), read by the
weighted sum (``p``): ``S (13 p + 5 [+ p + 4])``, dropout as above (ring attention's capped blocks skip those the
causal mask hides: an upper bound there).

**Memory-bound work** (norms, residual adds, rotary, activation functions, dropout, softmax of the loss), bytes read and
written in forward, ``p`` bytes per element, ``r`` the residual-stream elements the rank holds (``N d``; ``N d / tp``
with sequence parallelism or a grid): per block ``12 r p`` (two norms, two residual adds, dropouts) + ``2 r p`` for
each norm beyond two (``model.norm_placement=sandwich``: four) + rotary ``2 N (a + a_kv) h_d / tp p`` (as much again
for q/k norms, ``model.qk_norm``) + the MLP's activation ``3 N f / tp p`` (gpt2: 2; an MoE block's over its ``m``
assignments, plus their dispatch and combine ``(5 m d + 3 N_r d) p``: the rows gathered, weighted and added back into a
zeroed output); the head ``2 r p`` + the loss over the rank's vocabulary slice, ``N V / tp`` fp32 logits passed over 4
times in forward and backward by one rank's fused log-softmax, 11 times by the vocabulary-parallel one
(:data:`LOSS_BYTES`). An estimate: GPUs fuse some of it, and calibration measures only GEMMs.

**Parameters** (:func:`param_elements`): a dense block ``d (a + 2 a_kv) h_d + a h_d d + (3 | 2) d f`` matrix elements
plus norms (``d`` each, LayerNorm ``2 d``; two or four as ``model.norm_placement`` places them), q/k norms
(``model.qk_norm``: per head ``2 h_d``, a vector; full width ``(a + a_kv) h_d``, split with the heads like a matrix)
and the biases of the linears that have one
(:func:`~trickles.parallel.tensor.layout.block_linears`: ``model.qkv_bias``, ``o_bias``, ``mlp_bias``); an MoE block the
router ``d E`` and ``E`` experts of ``(3 | 2) d f_e``; the embedding ``V d``, gpt2's positions ``T_max d``, the final
norm, an untied output ``V d``. Tested equal to the built model's count. Latent attention (``model.attention=mla``)
has its own linears, head sizes and parameters (:mod:`~trickles.planner.compute_latent`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import ModelConfig
from ..models.masks import layer_window
from ..parallel.tensor.layout import bias_elements, block_norms, qk_norm_elements
from ..topology import ParallelDims
from .compute_latent import latent_linears, latent_params, latent_score_width

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


@dataclass(frozen=True)
class Gemm:
    """``count`` GEMMs ``[m, k] x [k, n]`` (``count`` may be fractional: a causal kernel's half); backward runs ``dx``
    products of the same FLOPs for the input's gradient and ``dw`` for the weight's (1 and 1 in full training; a
    frozen weight's ``dw`` is 0: :mod:`trickles.planner.compute_lora`); ``moved``: the bytes each of its products
    reads and writes, for a product timed on the memory's roofline as well (a LoRA adapter's rank-``r`` side)."""

    name: str
    m: int
    n: int
    k: int
    count: float = 1.0
    dx: float = 1.0
    dw: float = 1.0
    moved: float = 0.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def backward_flops(self) -> float:
        return self.flops * (self.dx + self.dw)


@dataclass(frozen=True)
class Work:
    """One micro-batch's forward on one rank (of some layers): GEMMs and memory-bound bytes."""

    gemms: tuple[Gemm, ...]
    elementwise_bytes: float
    attention_bytes: float = 0.0  # of elementwise_bytes: the attention core's score matrix (materialized kernels)

    @property
    def flops(self) -> float:
        return sum(g.flops for g in self.gemms)

    @property
    def backward_flops(self) -> float:
        return sum(g.backward_flops for g in self.gemms)

    def __add__(self, other: Work) -> Work:
        return Work(
            self.gemms + other.gemms,
            self.elementwise_bytes + other.elementwise_bytes,
            self.attention_bytes + other.attention_bytes,
        )


NO_WORK = Work((), 0.0)

#: Attention kernels the time model knows (module docstring): ``flash`` is what trickles runs.
ATTENTION = ("flash", "materialized")


def _gated(cfg: ModelConfig) -> bool:
    return cfg.flavor == "llama"


def linear_shape(dims: ParallelDims, tokens: int, h: int, h2: int, row: bool = False) -> tuple[int, int, int]:
    """``(M, N, K)`` of a linear ``h -> h'`` over ``tokens`` on one rank (module docstring); ``row``: 1-D's
    row-parallel linear (else column-parallel)."""
    tp, grid = dims.tp, dims.grid
    if tp == 1:
        return tokens, h2, h
    if grid.mode == "1d":
        return (tokens, h2, h // tp) if row else (tokens, h2 // tp, h)
    q = grid.q
    if grid.mode == "3d":
        return tokens // q, h2 // q, h // q
    return tokens // (q * grid.depth), h2 // q, h


def causal_pairs(seq: int, window: int | None = None) -> int:
    """The (query, key) entries a causal mask leaves in one head's ``[seq, seq]`` scores, with a sliding ``window``
    (query ``i`` sees keys ``i - window < j <= i``; None: all earlier keys): ``sum_{i<T} min(i + 1, w)``, which is
    ``T (T + 1) / 2`` for ``w >= T`` and ``w (w + 1) / 2 + (T - w) w`` otherwise."""
    w = seq if window is None else min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def block_work(
    cfg: ModelConfig,
    dims: ParallelDims,
    batch: int,
    seq: int,
    moe: bool,
    sequence_parallel: bool,
    p: int,
    attention: str = "flash",
    cp_mode: str = "ring",
    window: int | None = None,
) -> Work:
    """One block's forward for ``batch`` sequences of ``seq`` tokens on one rank (module docstring), its attention
    core run by kernel ``attention`` (:data:`ATTENTION`), context parallelism by ``cp_mode``, over a sliding
    ``window`` (None: full causal attention)."""
    d, hd, tp, cp = cfg.d_model, cfg.head_dim, dims.tp, dims.cp
    n = batch * seq // cp
    a, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    lin = lambda name, h, h2, row=False: Gemm(name, *linear_shape(dims, n, h, h2, row))  # noqa: E731
    gemms = [lin("qkv", d, a + 2 * kv), lin("o", a, d, row=True)]
    hk = hv = hd  # the scores' and the values' head sizes
    if cfg.attention == "mla":  # its compressions whole on every rank, the rest split by heads (.compute_latent)
        gemms = [Gemm(w, n, o, i) if rep else lin(w, i, o, w == "o_proj") for w, i, o, rep in latent_linears(cfg)]
        hk, hv = latent_score_width(cfg)
    heads = cfg.n_heads // tp if dims.grid.mode == "1d" else cfg.n_heads // dims.grid.q
    g = dims.grid
    seqs = batch if g.mode == "1d" else batch // (g.q * (g.q if g.mode == "3d" else g.depth))  # a grid rank's samples
    flash = attention == "flash" and cfg.attn_softcap is None  # soft-capped scores: the explicit path
    # a flash kernel computes the scores the causal mask and the window leave, P(T, w) of the T x T
    count = (causal_pairs(seq, window) / (seq * seq) if flash else 1.0) * seqs * heads
    rows = seq // cp
    if cp > 1 and cp_mode == "ulysses":  # whole sequences, 1/cp of the heads
        rows, count = seq, count / cp
    gemms += [Gemm("scores", rows, seq, hk, count), Gemm("weighted", rows, hv, seq, count)]
    scores = 0.0 if flash else seqs * heads * (seq // cp) * seq
    passes = 4 * p if cfg.attn_softcap is None else 13 * p + 5 + (p + 4 if p != 4 else 0)
    attention_bytes = scores * (passes + ((2 * p + 1) if cfg.dropout > 0 else 0))
    mats = 3 if _gated(cfg) else 2
    if moe:
        from ..memory.moe_activations import moe_assignments

        routed = n // tp if sequence_parallel and tp > 1 else n
        m = moe_assignments(cfg, batch, routed // batch, seq)
        local = cfg.moe_experts // dims.ep
        rows = max(1, m // local)
        f = cfg.moe_ffn_dim
        gemms += [Gemm("router", routed, cfg.moe_experts, d)]
        gemms += [Gemm("expert_in", rows, f, d, local * (mats - 1)), Gemm("expert_out", rows, d, f, local)]
        if cfg.moe_shared_experts:
            fs = f * cfg.moe_shared_experts
            gemms += [Gemm("shared_in", routed, fs, d, mats - 1), Gemm("shared_out", routed, d, fs)]
        ffn_elements = m * f + routed * f * cfg.moe_shared_experts
        dispatch = p * (5 * m * d + 3 * routed * d)
    else:
        f = cfg.ffn_dim
        gemms += [lin("mlp_in", d, (mats - 1) * f), lin("mlp_out", f, d, row=True)]
        ffn_elements = n * f / tp
        dispatch = 0
    split = tp if (sequence_parallel or dims.grid.mode != "1d") else 1
    r = n * d / split
    heads_elements = n * (cfg.n_heads + cfg.kv_heads) * hd / tp  # q and k: rotary (and q/k norms) read and write them
    if cfg.attention == "mla":  # rotary turns q_rot on the rank's heads and the one shared k_rot
        heads_elements = n * (cfg.n_heads // tp + 1) * cfg.qk_rope_head_dim
    extra_norms = block_norms(cfg) - 2  # sandwich: a norm on each branch's output as well
    elementwise = p * (
        (12 + 2 * extra_norms) * r
        + 2 * heads_elements * (2 if cfg.qk_norm != "none" else 1)
        + (3 if _gated(cfg) else 2) * ffn_elements
    )
    elementwise += dispatch
    return Work(tuple(gemms), elementwise + attention_bytes, attention_bytes)


def rebuilt_bytes(cfg: ModelConfig, dims: ParallelDims, batch: int, seq: int, sequence_parallel: bool, p: int) -> float:
    """The bytes one dense block's elementwise recomputation (:mod:`trickles.memory.recompute`) moves in one
    backward: each linear that reads a norm's output reruns the norm (reads ``x``, writes ``n``: ``2 r p``), the
    down projection reruns the activation (``3 N f / tp p``, gpt2 2) -- ``r`` as in :func:`block_work`; the linears
    reading the attention norm are q, k and v (one fused qkv), the MLP norm's gate and up (one fused, gpt2's up).
    Without norms before the branches (``model.norm_placement=post``) the linears read the residual stream: no norm
    reruns."""
    n = batch * seq // dims.cp
    split = dims.tp if sequence_parallel and dims.tp > 1 else 1
    r = n * cfg.d_model / split
    fused = cfg.fuses_projections
    readers = (1 if fused else 3) + (1 if fused or not _gated(cfg) else 2)
    readers *= cfg.norm_placement != "post"
    return p * (2 * r * readers + (3 if _gated(cfg) else 2) * n * cfg.ffn_dim / dims.tp)


#: fp32 bytes per logit the loss moves over forward and backward: one rank's fused log-softmax reads the logits and
#: writes its output, forward and backward (4 passes); the vocabulary-parallel one
#: (:mod:`trickles.parallel.tensor.layers`) takes the maximum, shifts, exponentiates, sums, divides and masks in forward
#: and scales in backward (11 passes).
LOSS_BYTES = {"whole": 4 * 4, "split": 11 * 4}


def head_work(cfg: ModelConfig, dims: ParallelDims, batch: int, seq: int, sequence_parallel: bool, p: int) -> Work:
    """The last stage's final norm, output layer ``d -> V`` and loss, for one micro-batch's forward (the loss's bytes
    a third of :data:`LOSS_BYTES`, as backward counts twice the forward's); soft-capped logits
    (``model.final_softcap``) add the cap's three passes over the rank's logits, divided, ``tanh``, multiplied back:
    ``6 p`` a logit."""
    n = batch * seq // dims.cp
    split = dims.tp if (sequence_parallel or dims.grid.mode != "1d") else 1
    vocab_split = dims.tp if dims.grid.mode == "1d" else dims.grid.q
    out = Gemm("output", *linear_shape(dims, n, cfg.d_model, cfg.vocab_size))
    loss = LOSS_BYTES["split" if vocab_split > 1 else "whole"] / 3 + (6 * p if cfg.final_softcap is not None else 0)
    return Work((out,), 2 * p * n * cfg.d_model / split + loss * n * cfg.vocab_size / vocab_split)


def chunk_work(
    cfg: ModelConfig,
    dims: ParallelDims,
    batch: int,
    seq: int,
    layers: list[int],
    last: bool,
    sequence_parallel: bool,
    p: int,
    attention: str = "flash",
    cp_mode: str = "ring",
) -> Work:
    """Forward work of ``layers`` (and the head if ``last``) for one micro-batch on one rank, each layer over its own
    sliding window (:func:`~trickles.models.masks.layer_window`)."""
    moe = set(cfg.moe_layers)
    cache: dict[tuple[bool, int | None], Work] = {}
    work = NO_WORK
    for i in layers:
        key = (i in moe, layer_window(cfg, i))
        if key not in cache:
            cache[key] = block_work(cfg, dims, batch, seq, key[0], sequence_parallel, p, attention, cp_mode, key[1])
        work = work + cache[key]
    if last:
        work = work + head_work(cfg, dims, batch, seq, sequence_parallel, p)
    return work


def attention_flops(work: Work) -> float:
    """The attention core's share of ``work``'s FLOPs (what selective recomputation reruns)."""
    return sum(g.flops for g in work.gemms if g.name in ("scores", "weighted"))


# ---- parameters --------------------------------------------------------------------------------


def block_params(cfg: ModelConfig, moe: bool) -> tuple[int, int, int]:
    """``(matrix elements, vector elements, expert elements)`` of one whole block (module docstring); a dense
    block's MLP counts as matrices, an MoE block's router as a matrix and its routed and shared experts as
    experts."""
    d, hd, gpt2 = cfg.d_model, cfg.head_dim, cfg.flavor == "gpt2"
    a, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    mats, mlp_bias = 3 if _gated(cfg) else 2, cfg.bias("mlp")
    matrices = d * (a + 2 * kv) + a * d
    vectors = (2 if gpt2 else 1) * d * block_norms(cfg) + bias_elements(cfg, ATTENTION_LINEARS)
    if cfg.attention == "mla":  # split by heads, or whole on every rank (:mod:`.compute_latent`)
        matrices, whole = latent_params(cfg)
        vectors += whole - bias_elements(cfg, ATTENTION_LINEARS)
    if cfg.qk_norm == "full":  # split with the heads, as the matrices are
        matrices += qk_norm_elements(cfg)[0]
    else:
        vectors += qk_norm_elements(cfg)[0]
    experts = 0
    if moe:
        f = cfg.moe_ffn_dim
        matrices += d * cfg.moe_experts
        experts = cfg.moe_experts * (mats * d * f + ((f + d) if mlp_bias else 0))  # up's and down's biases
        if cfg.moe_shared_experts:
            fs = f * cfg.moe_shared_experts
            experts += mats * d * fs + ((fs + d) if mlp_bias else 0)
    else:
        matrices += mats * d * cfg.ffn_dim
        vectors += bias_elements(cfg) - bias_elements(cfg, ATTENTION_LINEARS)
    return matrices, vectors, experts


def root_params(cfg: ModelConfig) -> dict[str, int]:
    """Elements outside the blocks: ``embedding``, ``positions``, ``norm`` (final), ``output`` (0 when tied)."""
    d = cfg.d_model
    return {
        "embedding": cfg.vocab_size * d,
        "positions": cfg.max_seq_len * d if cfg.flavor == "gpt2" else 0,
        "norm": 2 * d if cfg.flavor == "gpt2" else d,
        "output": 0 if cfg.tied else cfg.vocab_size * d,
    }


def param_elements(cfg: ModelConfig) -> int:
    """Every parameter element of the whole model."""
    moe = set(cfg.moe_layers)
    return sum(sum(block_params(cfg, i in moe)) for i in range(cfg.n_layers)) + sum(root_params(cfg).values())


def rank_params(
    cfg: ModelConfig, dims: ParallelDims, layers: list[int], first: bool, last: bool, sequence_parallel: bool = False
) -> tuple[int, int]:
    """``(dense, expert)`` parameter elements a rank holds for ``layers`` (plus the embedding and positions when
    ``first``, the final norm and output -- and a tied embedding's copy -- when ``last``): matrices split ``tp`` ways
    (2.5-D: ``q^2``, the depth holds copies), vectors whole under 1-D (``q`` ways on a grid), experts ``ep`` ways
    (whole on every 1-D tensor-parallel rank)."""
    grid = dims.grid
    mat_split = dims.tp if grid.mode != "2.5d" else grid.q * grid.q
    vec_split = 1 if grid.mode == "1d" else grid.q
    moe = set(cfg.moe_layers)
    dense = experts = 0
    for i in layers:
        m, v, e = block_params(cfg, i in moe)
        dense += m // mat_split + v // vec_split
        experts += e // dims.ep
    root = root_params(cfg)
    if first:
        dense += root["embedding"] // mat_split + root["positions"] // vec_split
    if last:
        dense += root["norm"] // vec_split + (root["output"] or (root["embedding"] if not first else 0)) // mat_split
    return dense, experts
