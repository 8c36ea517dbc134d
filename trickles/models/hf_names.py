"""The Hugging Face format in names: file and tensor names and tensor layouts, both ways.

What :func:`~trickles.models.hf.load_hf` (import) and :func:`~trickles.models.hf_export.save_hf` (export) share,
with no file read or written here: the directory's file names, :func:`weight_map` (every Hugging Face tensor and
the trickles parameter(s) it holds, :class:`Entry`) with :func:`to_ours` / :func:`to_hf` (the layout change of
each). The ``config.json`` translation is :mod:`trickles.models.hf_config`'.

Names, llama (``model_type: llama``; every tensor copied as is, ``[out, in]`` like ``nn.Linear``)::

    model.embed_tokens.weight                        embed.weight
    model.layers.{i}.input_layernorm.weight          layers.{i}.attn_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight layers.{i}.attn.{q,k,v,o}_proj.weight
    model.layers.{i}.post_attention_layernorm.weight layers.{i}.mlp_norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight  layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight                                norm.weight
    lm_head.weight                                   output.weight (absent when tied)

HF Llama checkpoints already use the rotate-half rotary convention this model uses, so q/k need
no permutation.

Names, mixtral (``model_type: mixtral``): a llama-flavour model whose every block is a mixture of
experts (``moe_every=1``, learned top-k routing, dropless, no shared experts). Attention, norms,
embeddings and head are named as in llama; each block's MLP is written per expert, the layout of
the published Mixtral checkpoints, which transformers 4.x reads as is and 5.x converts on load (5.x
``save_pretrained`` writes it too)::

    model.layers.{i}.block_sparse_moe.gate.weight          layers.{i}.mlp.router.weight
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight layers.{i}.mlp.experts.gate_proj.weight[j]
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight layers.{i}.mlp.experts.up_proj.weight[j]
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight layers.{i}.mlp.experts.down_proj.weight[j]

:func:`~trickles.models.hf.load_hf` also reads the fused layout of transformers 5.x's modules (``save_pretrained(...,
save_original_format=False)``): ``model.layers.{i}.mlp.gate.weight`` (the router),
``mlp.experts.gate_up_proj [E, 2F, d]`` (gate and up concatenated along dim 1) and
``mlp.experts.down_proj [E, d, F]``. Mixtral's router and its configuration: :mod:`trickles.models.hf_config`.

Names, gpt2 (``model_type: gpt2``). GPT-2's ``Conv1D`` stores weights ``[in, out]``: they are
transposed; ``c_attn`` is q, k and v fused along ``out`` (in that order) and is split::

    transformer.wte.weight                  embed.weight
    transformer.wpe.weight                  pos_embed.weight
    transformer.h.{i}.ln_1.{weight,bias}    layers.{i}.attn_norm.{weight,bias}
    transformer.h.{i}.attn.c_attn.weight    layers.{i}.attn.{q,k,v}_proj.weight = split(W.T, d, dim=0)
    transformer.h.{i}.attn.c_attn.bias      layers.{i}.attn.{q,k,v}_proj.bias = split(b, d)
    transformer.h.{i}.attn.c_proj.*         layers.{i}.attn.o_proj.*        (weight transposed)
    transformer.h.{i}.ln_2.*                layers.{i}.mlp_norm.*
    transformer.h.{i}.mlp.c_fc.*            layers.{i}.mlp.up_proj.*        (weight transposed)
    transformer.h.{i}.mlp.c_proj.*          layers.{i}.mlp.down_proj.*      (weight transposed)
    transformer.ln_f.{weight,bias}          norm.{weight,bias}
    lm_head.weight                          output.weight (absent when tied)

Checkpoints written without the ``transformer.`` prefix (the original ``gpt2`` upload) are read
too. Buffers some versions stored (GPT-2's ``attn.bias``/``attn.masked_bias`` causal masks,
Llama's ``rotary_emb.inv_freq``) are ignored; any other tensor not listed above is an error, as
is a listed tensor that is missing.

The ``config.json`` translation both ways, with what is refused and why, is :mod:`trickles.models.hf_config`'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .config import ModelConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Non-parameter buffers that some versions of transformers saved; safe to ignore.
IGNORED = re.compile(r"(^|\.)(h\.\d+\.attn\.(bias|masked_bias)|layers\.\d+\.self_attn\.rotary_emb\.inv_freq)$")


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor and the trickles parameter(s) it holds.

    ``kind``: ``copy`` (same layout), ``conv1d`` (HF stores the transpose), ``fused`` (HF
    concatenates ``ours`` along the output dimension; a 2-D one is also transposed), ``expert`` (HF
    holds slice ``index`` of the stacked ``ours[0]``, one expert's weight) or ``cat1`` (HF concatenates
    the stacked ``ours`` along dim 1, their output dimension).
    """

    hf: str
    ours: tuple[str, ...]
    kind: str = "copy"
    index: int = 0


def weight_map(cfg: ModelConfig, prefix: str = "transformer.", fused_experts: bool = False) -> list[Entry]:
    """Every tensor of a Hugging Face checkpoint of ``cfg``, in file order (``prefix``: gpt2 only;
    ``fused_experts``: Mixtral in transformers 5.x's fused layout instead of per expert)."""
    if cfg.flavor == "llama":
        out = [Entry("model.embed_tokens.weight", ("embed.weight",))]
        for i in range(cfg.n_layers):
            hf, us = f"model.layers.{i}.", f"layers.{i}."
            out.append(Entry(hf + "input_layernorm.weight", (us + "attn_norm.weight",)))
            out += [Entry(f"{hf}self_attn.{p}_proj.weight", (f"{us}attn.{p}_proj.weight",)) for p in "qkvo"]
            out.append(Entry(hf + "post_attention_layernorm.weight", (us + "mlp_norm.weight",)))
            if i not in cfg.moe_layers:
                out += [
                    Entry(f"{hf}mlp.{p}_proj.weight", (f"{us}mlp.{p}_proj.weight",)) for p in ("gate", "up", "down")
                ]
            elif fused_experts:
                ex = f"{us}mlp.experts."
                out += [
                    Entry(hf + "mlp.gate.weight", (us + "mlp.router.weight",)),
                    Entry(hf + "mlp.experts.gate_up_proj", (ex + "gate_proj.weight", ex + "up_proj.weight"), "cat1"),
                    Entry(hf + "mlp.experts.down_proj", (ex + "down_proj.weight",)),
                ]
            else:
                out.append(Entry(hf + "block_sparse_moe.gate.weight", (us + "mlp.router.weight",)))
                out += [
                    Entry(
                        f"{hf}block_sparse_moe.experts.{j}.{w}.weight",
                        (f"{us}mlp.experts.{p}_proj.weight",),
                        "expert",
                        j,
                    )
                    for j in range(cfg.moe_experts)
                    for w, p in (("w1", "gate"), ("w2", "down"), ("w3", "up"))
                ]
        out.append(Entry("model.norm.weight", ("norm.weight",)))
    else:
        p = prefix
        out = [Entry(p + "wte.weight", ("embed.weight",)), Entry(p + "wpe.weight", ("pos_embed.weight",))]
        for i in range(cfg.n_layers):
            hf, us = f"{p}h.{i}.", f"layers.{i}."
            for leaf in ("weight", "bias"):
                kind = "conv1d" if leaf == "weight" else "copy"
                out.append(Entry(f"{hf}ln_1.{leaf}", (f"{us}attn_norm.{leaf}",)))
                out.append(Entry(f"{hf}attn.c_attn.{leaf}", tuple(f"{us}attn.{x}_proj.{leaf}" for x in "qkv"), "fused"))
                out.append(Entry(f"{hf}attn.c_proj.{leaf}", (f"{us}attn.o_proj.{leaf}",), kind))
                out.append(Entry(f"{hf}ln_2.{leaf}", (f"{us}mlp_norm.{leaf}",)))
                out.append(Entry(f"{hf}mlp.c_fc.{leaf}", (f"{us}mlp.up_proj.{leaf}",), kind))
                out.append(Entry(f"{hf}mlp.c_proj.{leaf}", (f"{us}mlp.down_proj.{leaf}",), kind))
        out += [Entry(f"{p}ln_f.{leaf}", (f"norm.{leaf}",)) for leaf in ("weight", "bias")]
    if not cfg.tied:
        out.append(Entry("lm_head.weight", ("output.weight",)))
    return out


def to_ours(entry: Entry, t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The trickles tensors held in HF tensor ``t`` (``sizes``: output sizes of a fused entry); for an
    ``expert`` entry, the slice ``entry.index`` of ``ours[0]``."""
    if entry.kind in ("copy", "expert"):
        return [t]
    if entry.kind == "conv1d":
        return [t.t()]
    if entry.kind == "cat1":
        return list(t.split(sizes, dim=1))
    return list((t.t() if t.dim() == 2 else t).split(sizes, dim=0))


def to_hf(entry: Entry, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`to_ours`."""
    if entry.kind == "copy":
        return tensors[0]
    if entry.kind == "expert":
        return tensors[0][entry.index].clone()  # its own storage: safetensors refuses shared tensors
    if entry.kind == "conv1d":
        return tensors[0].t()
    if entry.kind == "cat1":
        return torch.cat(tensors, dim=1)
    fused = torch.cat(tensors, dim=0)
    return fused.t() if fused.dim() == 2 else fused


def _hf_shape(entry: Entry, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if entry.kind == "copy":
        return shapes[0]
    if entry.kind == "conv1d":
        return shapes[0][::-1]
    if entry.kind == "expert":
        return shapes[0][1:]
    if entry.kind == "cat1":
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])
    out = sum(s[0] for s in shapes)
    return (shapes[0][1], out) if len(shapes[0]) == 2 else (out,)


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"dtype {dtype!r} is not a floating-point torch dtype; use e.g. 'float32' or 'bfloat16'")
    return value
