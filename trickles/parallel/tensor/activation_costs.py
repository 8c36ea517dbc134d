"""What a tensor-parallel grid rank saves for backward, and its largest temporaries: stated once.

Pure functions of a :class:`~trickles.models.config.ModelConfig`, a :class:`~.layout.Layout` (2-D, 2.5-D or 3-D
with side ``q``; 1-D delegates to :func:`~trickles.memory.activations.activation_bytes`), the micro-batch ``B``, the
sequence ``T`` and ``p`` bytes per element of the compute type. The memory report (:mod:`trickles.memory.report`,
:mod:`trickles.memory.tp_modes`) and the planner read them; the saved-tensor hooks
(:class:`~trickles.memory.activations.ActivationMeter`) are tested equal to them, byte for byte, and the measured
peaks against the temporaries (``tests/distributed/test_memory_grid_peak.py``).

Notation as in :mod:`trickles.parallel.tensor.costs`: ``N = B T`` tokens of a micro-batch, ``n`` of them on this
rank (:meth:`~.layout.Layout.tokens`); ``d`` model width, ``a``/``a_kv`` query/key-value heads of size ``h``, ``f``
MLP width, ``V`` vocabulary.

**Activations** (:func:`activation_bytes_nd`) a rank saves for backward per block (grids; 1-D is
:func:`~trickles.memory.activations.activation_bytes`), with ``a_l = a/q``, ``a_kv,l = a_kv/q``, ``f_l = f/q`` and
``W`` the block's weight elements:

==========  ==================================================================  ===============================
piece       saved                                                               bytes
==========  ==================================================================  ===============================
norm        input, fp32 ``1/rms`` (LayerNorm: mean and ``1/std``)                ``p n d/q + 4n`` (LN ``8n``)
linears     each its gathered input (2-D: the row's ``[n, h]``; 3-D: the        ``p n sum(h) + p W/q``
            token block ``[q n, h/q]``) and its gathered weight (2-D: the       (3-D ``p W/q^2``), the sum
            column's ``[h'/q, h]``; 3-D ``[h'/q, h/q]``)                        over the linears' inputs
attention   q, k, v after rotation, the fused kernel's output, fp32             ``p n (2 a_l h + 2 a_kv,l h)
            log-sum-exp (llama in low precision without Triton: cos/sin cast   + 4 n a_l (+ 4 T h p)``
            for q and k; the Triton kernel keeps only the tables)
MLP         llama: gate and up (silu recomputed in backward); gpt2: the         ``2 p n f_l`` / ``p n f_l``
            pre-activation
==========  ==================================================================  ===============================

Soft-capped scores (``model.attn_softcap``) keep, in place of the fused kernel's output and log-sum-exp, what
:mod:`trickles.memory.attention_cores` counts for the rank's ``n / T`` sequences and ``a_l`` heads, less the output
(``o_proj`` keeps its gathered copy, not the core's). ``selective`` recomputation drops the attention core's output
and log-sum-exp, ``p n a_l h + 4 n a_l`` (the
output projection keeps a gathered copy, not the core's output); ``full`` keeps the block input, ``p n d/q``.
The head keeps the token ids (the whole micro-batch's ``8N``: a rank's rows are a view; 3-D: its column's
shifted ids and out-of-range mask, ``9 N/q``), gpt2's positions ``8T``, the final norm, the output layer's
gathered input and weight (``p n d + p V d/q``, 3-D ``p V d/q^2``), the loss's fp32 probabilities ``4 n V/q``,
target index (int64) and mask, and its fp32 token count: ``4 n V/q + 9n + 4``.
"""

from __future__ import annotations

from ...memory.attention_cores import core_bytes
from ...models.config import ModelConfig
from .layout import Layout, block_linears


def activation_bytes_nd(
    cfg: ModelConfig, lay: Layout, batch: int, seq: int, p: int = 4, recompute: str = "none", device_type: str = "cpu"
) -> dict:
    """What a rank saves for backward for one micro-batch, in the keys of
    :func:`~trickles.memory.activations.activation_bytes` (``layer``, ``per_layer``, ``layers``, ``head``, ``tables``,
    ``total``, ``loss``: the part of the head the loss's own nodes save); a grid's terms in the module docstring, 1-D
    delegates."""
    if not lay.grid:
        from ...memory.activations import activation_bytes

        return activation_bytes(cfg, batch, seq, recompute, p, device_type, lay.tp, lay.sequence_parallel)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full on a tensor-parallel grid, got {recompute!r}")
    from ...kernels import runs_triton

    q, n, llama = lay.q, lay.tokens(batch, seq), cfg.flavor == "llama"
    rotary = runs_triton(cfg.kernels, device_type, "rotary")
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    a, kv, fl = cfg.n_heads // q, cfg.kv_heads // q, f // q
    mat = q * q if lay.mode == "3d" else q
    norm = p * n * d // q + (4 if llama else 8) * n
    linears = sum(p * n * h + p * h * h2 // mat for _, h, h2, _ in block_linears(cfg))
    core = p * n * a * hd + 4 * n * a  # the fused kernel's output and log-sum-exp
    if cfg.attn_softcap is not None:  # the explicit path keeps neither, its scores' tensors instead
        core += core_bytes(cfg, 0, n // seq, seq, a, kv, p, output_kept=False)
    attention = p * n * (a * hd + 2 * kv * hd) + core + (4 * seq * hd * p if llama and p != 4 and not rotary else 0)
    mlp = (2 if llama else 1) * p * n * fl
    layer = {
        "none": 2 * norm + linears + attention + mlp,
        "selective": 2 * norm + linears + attention + mlp - core,
        "full": p * n * d // q,
    }[recompute]
    v, n_all = cfg.vocab_size, batch * seq
    ids = 9 * n_all // q if lay.mode == "3d" else 8 * n_all
    loss = 4 * n * (v // q) + 9 * n + 4  # the loss's own: its probabilities, ids and mask, the target count
    head = ids + (0 if llama else 8 * seq) + norm + p * n * d + p * v * d // mat + loss
    per_layer = [layer] * cfg.n_layers
    return {
        "layer": layer,
        "moe_layer": 0,
        "per_layer": per_layer,
        "layers": sum(per_layer),
        "head": head,
        "tables": 0,
        "total": sum(per_layer) + head,
        "loss": loss,
    }


def loss_transient_nd(cfg: ModelConfig, lay: Layout, batch: int, seq: int) -> int:
    """A grid's loss beyond what it keeps (the probabilities, fp32 ``[n, V/q]``): its forward, where the fp32 logits
    and their shifted copy are alive while the exponentials (kept as the probabilities) are written, two fp32
    ``[n, V/q]``; its backward needs only one (the gradient), so the forward sets the loss's peak."""
    return 2 * 4 * lay.tokens(batch, seq) * (cfg.vocab_size // lay.q)


def head_released_nd(cfg: ModelConfig, lay: Layout, batch: int, seq: int, p: int = 4) -> int:
    """What the head's backward has released when the last block's backward starts: ``activation_bytes_nd``'s head
    less the token ids (and gpt2's positions) the embedding keeps to the end of backward."""
    n_all = batch * seq
    ids = 9 * n_all // lay.q if lay.mode == "3d" else 8 * n_all
    head = activation_bytes_nd(cfg, lay, batch, seq, p)["head"]
    return head - ids - (0 if cfg.flavor == "llama" else 8 * seq)


def backward_transient_nd(
    cfg: ModelConfig, lay: Layout, batch: int, seq: int, p: int = 4, device_type: str = "cpu"
) -> int:
    """A grid's largest temporaries in a block's backward, alive together at the input gradient of the widest linear
    (the MLP's down projection, ``h = f`` in; the first the last block's backward runs, when all the blocks' saved
    activations are still held), for ``n`` tokens per rank and ``p`` bytes per element:

    * the residual stream's gradient arriving, ``p n d / q``;
    * 3-D: ``dY`` all-gathered over the tokens' sub-split (:class:`~trickles.parallel.tensor.grid_linear.Linear3D`),
      ``[q n, d/q]``: ``p n d``;
    * the partial product ``dX = dY A^T`` before its reduce-scatter, ``P = p n h`` (2-D, 2.5-D: ``[n, h]``; 3-D:
      ``[q n, h/q]``, the same bytes);
    * 2-D and 2.5-D scatter along the features (the last dimension): :meth:`~trickles.comm.GroupComm.reduce_scatter`
      lays the chunks out one after another first, one more ``P``;
    * on a CPU, gloo's reduce-scatter works on a copy of its input, one more ``P`` (NCCL does not);
    * the rank's chunk of the result, ``P / q``.

    In all: ``p n d / q + [3-D] p n d + (1 + [2-D, 2.5-D] + [CPU]) P + P / q``. The weight gradient's product,
    ``[d/q, h]``, comes after the input gradient's temporaries are released and is smaller for any ``n > d / q``."""
    if not lay.grid:
        raise ValueError("backward_transient_nd is a grid's (1-D: trickles.memory.activations)")
    q, n, d = lay.q, lay.tokens(batch, seq), cfg.d_model
    h = max(h_in for _, h_in, _, _ in block_linears(cfg))
    partial = p * n * h
    copies = 1 + (lay.mode != "3d") + (device_type != "cuda")
    gathered = p * n * d if lay.mode == "3d" else 0
    return p * n * d // q + gathered + copies * partial + partial // q
