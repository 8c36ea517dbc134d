"""What a LoRA run (``train.lora_rank > 0``, :mod:`trickles.adapters.lora`) computes, against full training's
:mod:`trickles.planner.compute`.

Every base parameter is frozen; only the adapters ``A [r, in]`` and ``B [out, r]`` of the targets train. A
:class:`~trickles.planner.compute.Gemm` says which of its backward products run: ``dx`` (the input's gradient, the
same FLOPs as the forward product) and ``dw`` (the weight's). Full training runs both (``3 x`` the forward); here:

* a **frozen linear** (every base projection, the router and experts, the output layer; an int8 base's product as
  well, :mod:`trickles.adapters.int8_base`, its codes' widening -- an element-wise pass over the weight in forward and
  backward -- left out) runs ``dx`` only, and nothing when its input needs no gradient: ``2 x`` the forward, ``1 x``;
* the **attention core** (scores, weighted sum) keeps its backward, ``2 x`` the forward, while q, k or v needs a
  gradient;
* each **adapter** on ``N`` tokens of a linear ``in -> out`` (a fused projection's adapted part: ``out`` the part's
  rows) adds forward ``u = A x``, ``2 N r in``, and ``y += s B u``, ``2 N r out``; backward ``du = s dy B`` and
  ``dB = s dy^T u``, ``2 N r out`` each, ``dA = du^T x``, ``2 N r in``, and, when its input needs a gradient,
  ``dx = du A``, ``2 N r in``: ``6 N r (in + out)`` in all, ``2 N r in`` less without the input's gradient.
  Under 1-D tensor parallelism each adapter is split as its base weight (:mod:`trickles.adapters.tensor`): a
  column-parallel rank runs ``A`` whole, ``[N, in] x [in, r]``, and its rows of ``B``, ``[N, r] x [r, out/tp]``;
  a row-parallel one its columns of ``A``, ``[N, in/tp] x [in/tp, r]``, and ``B`` whole, ``[N, r] x [r, out]``;
  latent attention's compressions are whole on every rank, their adapters too.

**Which inputs need a gradient.** The embedding is frozen, so the residual stream needs none until a trained
parameter has acted on it: in the first block (the stage holding the embedding) the projections reading the block's
input (q, k, v or qkv; latent attention's ``q_a_proj`` / ``q_proj`` and ``kv_a_proj_with_mqa``, their ``_b``
projections when their ``_a`` one is not adapted) compute no input gradient, the attention core and ``o_proj`` none
while no q/k/v projection is adapted, the MLP's down projection none while neither gate nor up is; from the first
adapted projection on, every input needs one. Later pipeline stages receive an input that needs a gradient.

Element-wise work (norms, activations) keeps full training's backward bytes (its weights' gradients are a small part of
it). Tested against ``torch.utils.flop_counter.FlopCounterMode`` on a real LoRA step.
"""

from __future__ import annotations

import dataclasses

from ..adapters.lora import LoRASettings
from ..memory.lora_activations import adapted_per_layer
from ..models.config import ModelConfig
from ..models.fused import FUSED_PARTS
from ..models.masks import layer_window
from ..models.mla_config import latent_linears
from ..topology import ParallelDims
from .compute import NO_WORK, Gemm, Work, block_work, head_work

CORE = ("scores", "weighted")
READ_INPUT = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa")  # read the block's (normed) input
SECOND = {"q_b_proj": "q_a_proj", "kv_b_proj": "kv_a_proj_with_mqa"}  # latent attention: read their _a's output
ROW = ("o_proj", "down_proj")


def adapters(
    mc: ModelConfig, lora: LoRASettings
) -> tuple[list[list[tuple[str, int, int]]], list[tuple[str, int, int]]]:
    """``(per block [(name, in, out)], root [...])``: one entry per adapter, a fused projection's adapted parts each
    under the part's name with the part's rows (what :func:`~trickles.adapters.lora.apply_lora` adds)."""
    blocks, root = adapted_per_layer(mc, lora.targets)
    a, kv = mc.n_heads * mc.head_dim, mc.kv_heads * mc.head_dim
    rows = {"q_proj": a, "k_proj": kv, "v_proj": kv, "gate_proj": mc.ffn_dim, "up_proj": mc.ffn_dim}

    def expand(entries: list) -> list[tuple[str, int, int]]:
        out = []
        for leaf, n_in, n_out, _ in entries:
            parts = [p for p in FUSED_PARTS.get(leaf, ()) if p in lora.targets or leaf in lora.targets]
            out += [(p, n_in, rows[p]) for p in parts] if parts else [(leaf, n_in, n_out)]
        return out

    return [expand(b) for b in blocks], expand(root)


def _split(mc: ModelConfig, name: str, tp: int) -> str:
    """How 1-D tensor parallelism over ``tp`` ranks splits linear ``name``'s weight: ``row``, ``column`` or
    ``whole`` (latent attention's compressions; key/value projections when ``tp`` does not divide their heads)."""
    if tp == 1 or (mc.attention == "mla" and any(n == name and rep for n, _, _, rep in latent_linears(mc))):
        return "whole"
    if name in ("k_proj", "v_proj") and mc.kv_heads % tp and not mc.fuses_projections:
        return "whole"
    return "row" if name in ROW else "column"


def adapter_gemms(mc: ModelConfig, dims: ParallelDims, n: int, p: int, rank: int, entries: list, live: dict) -> list:
    """The forward products of ``entries``' adapters (:func:`adapters`) on ``n`` tokens of one rank, ``live[name]``
    whether the adapted linear's input needs a gradient, ``p`` bytes an element (module docstring)."""
    tp, out = dims.tp, []
    for name, n_in, n_out in entries:
        split = _split(mc, name, tp)
        k_in = n_in // tp if split == "row" else n_in
        n_b = n_out // tp if split == "column" else n_out
        out += [
            Gemm(f"lora_A.{name}", n, rank, k_in, dx=float(live[name]), moved=p * (n * k_in + k_in * rank + n * rank)),
            Gemm(f"lora_B.{name}", n, n_b, rank, moved=p * (n * rank + rank * n_b + n * n_b)),
        ]
    return out


def adapter_elements(mc: ModelConfig, lora: LoRASettings, layers: list[int], last: bool, tp: int = 1) -> int:
    """The adapter values a 1-D tensor-parallel rank holds (and trains) for ``layers`` and, when ``last``, the output
    projection's: ``r (in + out)`` per adapter, the split factor (column: ``B``; row: ``A``) ``1/tp`` of it."""
    blocks, root = adapters(mc, lora)
    total = 0
    for name, n_in, n_out in [e for i in layers for e in blocks[i]] + (root if last else []):
        split = _split(mc, name, tp)
        total += lora.rank * ((n_in // tp if split == "row" else n_in) + (n_out // tp if split == "column" else n_out))
    return total


def adapter_partial_elements(mc: ModelConfig, lora: LoRASettings, layers: list[int], last: bool, tp: int) -> int:
    """The adapter gradient elements a 1-D tensor-parallel rank computes from its part of the data and sums over
    ``tp`` once a step (the frozen norms' are not reduced): a column-parallel adapter's whole ``A`` (``r in``), a
    row-parallel one's whole ``B`` (``r out``), both of an adapter kept whole (:mod:`trickles.adapters.tensor`)."""
    if tp <= 1:
        return 0
    blocks, root = adapters(mc, lora)
    split = {"column": lambda n_in, n_out: n_in, "row": lambda n_in, n_out: n_out, "whole": lambda a, b: a + b}
    modules = [e for i in layers for e in blocks[i]] + (root if last else [])
    return sum(lora.rank * split[_split(mc, name, tp)](n_in, n_out) for name, n_in, n_out in modules)


def lora_block(
    work, mc: ModelConfig, dims: ParallelDims, n: int, p: int, lora: LoRASettings, entries: list, live: bool
):
    """``(work, live)``: one block's forward ``work`` (:func:`~trickles.planner.compute.block_work`, on ``n`` tokens
    of the rank) with each product's backward as a LoRA run runs it and ``entries``' adapters added; ``live``:
    whether the block's input needs a gradient, before and after the block (module docstring)."""
    names = {e[0] for e in entries}
    attn_in = live
    core = live or bool(
        names & {"q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
    )
    after_attn = core or "o_proj" in names
    down_in = after_attn or bool(names & {"gate_proj", "up_proj"})
    needs = {name: attn_in for name in READ_INPUT}
    needs.update({name: attn_in or first in names for name, first in SECOND.items()})
    needs.update(qkv=attn_in, o=core, o_proj=core, gate_proj=after_attn, up_proj=after_attn, down_proj=down_in)
    needs.update(mlp_in=after_attn, mlp_out=down_in)
    gemms = []
    for g in work.gemms:
        if g.name in CORE:
            gemms.append(dataclasses.replace(g, dx=float(core), dw=float(core)))
        else:  # a frozen product: its input's gradient only (the mixture of experts' products read a live input)
            gemms.append(dataclasses.replace(g, dx=float(needs.get(g.name, after_attn)), dw=0.0))
    gemms += adapter_gemms(mc, dims, n, p, lora.rank, entries, needs)
    return dataclasses.replace(work, gemms=tuple(gemms)), down_in or "down_proj" in names


def lora_head(work, mc: ModelConfig, dims: ParallelDims, n: int, p: int, lora: LoRASettings, entries: list, live: bool):
    """The head's forward ``work`` (:func:`~trickles.planner.compute.head_work`) of a LoRA run: the frozen output
    layer's input gradient while its input needs one, and its adapter when ``output`` is a target."""
    gemms = tuple(dataclasses.replace(g, dx=float(live), dw=0.0) for g in work.gemms)
    extra = adapter_gemms(mc, dims, n, p, lora.rank, entries, {e[0]: live for e in entries})
    return dataclasses.replace(work, gemms=gemms + tuple(extra))


def lora_chunk_work(
    cfg: ModelConfig,
    dims: ParallelDims,
    batch: int,
    seq: int,
    layers: list[int],
    last: bool,
    sequence_parallel: bool,
    p: int,
    lora: LoRASettings,
    attention: str = "flash",
    cp_mode: str = "ring",
) -> Work:
    """:func:`~trickles.planner.compute.chunk_work` of a LoRA run: the same forward products, each with the backward
    a LoRA run runs, and the adapters' products; the residual stream needs no gradient before the first adapter when
    ``layers`` start at the first block (module docstring)."""
    blocks, root = adapters(cfg, lora)
    n = batch * seq // dims.cp
    moe = set(cfg.moe_layers)
    cache: dict[tuple[bool, int | None], Work] = {}
    work, live = NO_WORK, bool(layers) and layers[0] != 0
    for i in layers:
        key = (i in moe, layer_window(cfg, i))
        if key not in cache:
            cache[key] = block_work(cfg, dims, batch, seq, key[0], sequence_parallel, p, attention, cp_mode, key[1])
        block, live = lora_block(cache[key], cfg, dims, n, p, lora, blocks[i], live)
        work = work + block
    if last:
        head = head_work(cfg, dims, batch, seq, sequence_parallel, p)
        work = work + lora_head(head, cfg, dims, n, p, lora, root, live or not layers)
    return work
