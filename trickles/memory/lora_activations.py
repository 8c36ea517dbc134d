"""What a LoRA run's autograd keeps for backward, against full training's (:mod:`trickles.memory.activations`).

Only the adapters train (:mod:`trickles.adapters.lora`), so a frozen linear keeps nothing for a weight gradient: the
base's ``x W^T`` (or an int8 base's, :mod:`trickles.adapters.int8_base`) keeps no input, only its own weight. What
changes, with ``s`` the tokens of a micro-batch, ``s_n`` the tokens a norm sees, ``r`` the rank and ``p`` bytes per
element of the compute type:

==========================  ========================================================================  ================
piece                       kept for backward                                                          bytes
==========================  ========================================================================  ================
each adapter (per part of   ``B`` keeps ``A``'s output ``u = A x``                                    ``+ p s r``
a fused projection)
each adapted module with    ``A`` keeps ``dropout(x)`` and the dropout its mask (CPU: of ``x``'s      ``+ (p + q) s in``
``train.lora_dropout > 0``  type, ``q = p``; CUDA ``q = 1``), not ``x``
a norm's output             kept only by an adapter without dropout on the linears it feeds           ``- p s_n d``
                            (``q/k/v_proj``; ``gate/up_proj``): none of them, nothing keeps it
the down projection's       kept only by its adapter without dropout (the activation's own node       ``- p s f``
input                       keeps its inputs, not its product)
the first block's first     its input (the frozen embedding's output) needs no gradient: it keeps     ``-(p d + 4) s_n``
norm                        nothing, and a dropout on its output no mask                              ``(- q s d)``
the first block's q, k      without their adapters they need no gradient: in low precision their      ``- 2 T h p`` each
                            rotary tables' casts are not kept
the embedding               frozen: keeps nothing (its ids; gpt2's positions; a dropout's mask)        ``- 8 s``
the output projection       frozen: keeps no input (unless it is a target: then as an adapter)        ``- p s d``
==========================  ========================================================================  ================

``o_proj``'s input is the attention core's output, which the core keeps whatever trains. Measured to the byte
(``tests/unit/test_memory_lora.py``) for llama-flavour dense blocks (fp32 and bf16, any recomputation, the fused loss
unless the output projection is adapted) without tensor, context or pipeline parallelism, packed-document masks or
model dropout, where every block adapts at least one of ``q/k/v_proj``; elsewhere the same terms are applied to full
training's counts as an estimate (:func:`lora_exact` says which, and the report says so).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..adapters.lora import LoRASettings, target_linears
from ..models.config import ModelConfig
from .precision import policy

ATTENTION_INPUT = ("q_proj", "k_proj", "v_proj", "qkv_proj")
MLP_INPUT = ("gate_proj", "up_proj", "gate_up_proj")
_ADAPTED: OrderedDict = OrderedDict()  # per (model, targets): each block's adapted modules (a meta model's build)


def adapted_per_layer(model_cfg: ModelConfig, targets: tuple[str, ...]) -> tuple[list[list], list]:
    """``(per block [(leaf, in_features, out_features, adapters)], root [...])``: the modules
    :func:`~trickles.adapters.lora.apply_lora` adapts (``adapters``: a fused projection's adapted parts, else 1), from
    the model built on the meta device once per shape."""
    key = (repr(model_cfg), targets)
    if key not in _ADAPTED:
        from ..models.transformer import Transformer

        with torch.device("meta"):
            model = Transformer(model_cfg)
        blocks, root = [[] for _ in range(model_cfg.n_layers)], []
        for name, lin, parts in target_linears(model, targets):
            entry = (name.rsplit(".", 1)[-1], lin.in_features, lin.out_features, max(len(parts), 1))
            top, _, rest = name.partition(".")
            if top == "layers":
                blocks[int(rest.partition(".")[0])].append(entry)
            elif top == "output":  # (other modules' adapters, multi-token prediction's say, are not counted)
                root.append(entry)
        _ADAPTED[key] = (blocks, root)
        while len(_ADAPTED) > 8:
            _ADAPTED.popitem(last=False)
    return _ADAPTED[key]


def lora_exact(cfg, model_cfg: ModelConfig, tp: int, cp: int, pp: int = 1) -> bool:
    """Whether :func:`lora_activations`'s counts are measured exact for this run (module doc) rather than an
    estimate."""
    blocks, root = adapted_per_layer(model_cfg, tuple(cfg.train.lora_targets))
    return (
        model_cfg.flavor == "llama"
        and not model_cfg.moe_experts
        and model_cfg.norm_placement == "pre"
        and model_cfg.dropout == 0
        and tp == cp == pp == 1
        and not (root and model_cfg.fused_loss)
        and not cfg.data.document_mask
        and all(any(entry[0] in ATTENTION_INPUT for entry in block) for block in blocks)
    )


def lora_activations(
    act: dict,
    model_cfg: ModelConfig,
    lora: LoRASettings,
    s: int,
    sn: int,
    p: int,
    tp: int,
    device_type: str,
    recompute: str = "none",
    fused_loss: bool = False,
    rope_cast: int = 0,
) -> dict:
    """``act`` (:func:`~trickles.memory.activations.activation_bytes`'s dict for full training, its layers
    recomputed as ``recompute`` says) with a LoRA run's terms (module doc): ``per_layer``, ``layers``, ``head``,
    ``embedding`` and ``total`` changed. ``rope_cast``: the bytes of the rotary tables' casts kept for one of q, k
    (low-precision llama: ``2 T h p``)."""
    blocks, root = adapted_per_layer(model_cfg, lora.targets)
    d, f = model_cfg.d_model, model_cfg.ffn_dim // tp
    mask = 1 if device_type == "cuda" else p
    drop = lora.dropout > 0
    llama = model_cfg.flavor == "llama"
    moe = set(model_cfg.moe_layers)
    row_parallel = ("o_proj", "down_proj")

    def adapters(modules: list) -> int:
        total = 0
        for leaf, n_in, _, parts in modules:
            total += parts * p * s * lora.rank
            if drop:  # dropout(x) and its mask, on this rank's part of x
                total += (p + mask) * s * (n_in // tp if leaf in row_parallel else n_in)
        return total

    per_layer = list(act["per_layer"])
    for i, modules in enumerate(blocks if recompute != "full" else []):  # (full: each block keeps its input alone)
        leaves = {entry[0] for entry in modules}
        delta = adapters(modules)
        if drop or not leaves & set(ATTENTION_INPUT):
            delta -= p * sn * d
        if i not in moe:  # (a mixture of experts' MLP is never adapted: its norm's output is the router's input)
            if drop or not leaves & set(MLP_INPUT):
                delta -= p * sn * d
            if drop or "down_proj" not in leaves:
                delta -= p * s * f
        if i == 0:  # the first norm's input needs no gradient, nor its output: dropout on it keeps no mask
            delta -= p * sn * d + (4 * sn if llama else 2 * p * sn)
            if drop:
                delta -= sum(mask * s * n_in for leaf, n_in, _, _ in modules if leaf in ATTENTION_INPUT)
            if "qkv_proj" not in leaves:  # nor q or k without their adapters: no rotary tables' casts kept for them
                delta -= rope_cast * (("q_proj" not in leaves) + ("k_proj" not in leaves))
        per_layer[i] += delta
    # the embedding, frozen, keeps nothing (its ids, gpt2's positions, its dropout's mask on an output needing no
    # gradient); the output projection keeps no input unless adapted without dropout
    if fused_loss:  # the chunked loss keeps no fp32 gradient of the frozen weight (and never the norm's output)
        output = adapters(root) - 4 * (model_cfg.vocab_size // tp) * d
    else:
        output = adapters(root) + (0 if root and not drop else -p * s * d)
    head = act["head"] - act["embedding"] + output
    layers = sum(per_layer)
    return dict(
        act,
        per_layer=per_layer,
        layers=layers,
        head=head,
        embedding=0,
        total=act["total"] - act["layers"] - act["head"] + layers + head,
    )


def with_lora(act: dict, cfg, model_cfg: ModelConfig, lay, dims, device_type: str, recompute: str) -> dict:
    """``act`` for ``cfg``'s LoRA adapters (unchanged without ``train.lora_rank``; a tensor-parallel grid refuses
    LoRA), on ``lay``'s 1-D rank, its layers recomputed as ``recompute`` says."""
    from ..kernels.cross_entropy import fused_on

    lora = cfg.train.lora()
    if lora is None or lay.grid:
        return act
    p = torch.finfo(policy(cfg.memory.precision, cfg.memory.grad_dtype).param_dtype).bits // 8
    micro, _ = cfg.batch_plan(dims.dp)
    s = micro * cfg.data.seq_len // dims.cp
    sn = s // lay.tp if lay.sequence_parallel and lay.tp > 1 else s
    fused = fused_on(model_cfg.fused_loss, model_cfg.kernels, device_type)
    tokens = s if cfg.data.document_mask else cfg.data.seq_len // dims.cp  # (as activation_bytes casts them)
    cast = 2 * tokens * model_cfg.head_dim * p if model_cfg.flavor == "llama" and p != 4 else 0
    return lora_activations(act, model_cfg, lora, s, sn, p, lay.tp, device_type, recompute, fused, cast)


def lora_note(cfg, model_cfg: ModelConfig, dims) -> str:
    """The report's line on a LoRA run's memory."""
    lora = cfg.train.lora()
    base = "per-row int8 codes and fp32 scales" if lora.base == "int8" else "the parameters' type"
    exact = lora_exact(cfg, model_cfg, dims.tp, dims.cp, dims.pp)
    return (
        f"LoRA rank {lora.rank}: gradients and optimizer state for the adapters only, the adapted base weights in "
        f"{base}; activations: the adapters' inputs and rank-{lora.rank} products, nothing for frozen weights' "
        + ("gradients (measured exact for this layout)" if exact else "gradients (an estimate for this layout)")
    )


def lora_states(model_cfg: ModelConfig, lora: LoRASettings, layers: list[int], last: bool, tp: int):
    """``(adapters, codes, scales)``: at least the adapter values, int8 codes and scales (``lora.base="int8"``; else 0)
    a tensor-parallel rank holds for ``layers`` (and the output projection's when ``last``) -- each adapted module's
    ``r (parts * in + out)`` adapter values and ``in * out`` codes split ``tp`` ways (a lower bound: an adapter keeps
    one of its two factors whole)."""
    blocks, root = adapted_per_layer(model_cfg, lora.targets)
    modules = [m for i in layers for m in blocks[i]] + (root if last else [])
    adapters = sum(lora.rank * (parts * n_in + n_out) for _, n_in, n_out, parts in modules) // tp
    if lora.base != "int8":
        return adapters, 0, 0
    return adapters, sum(n_in * n_out for _, n_in, n_out, _ in modules) // tp, sum(m[2] for m in modules) // tp
