"""Multi-token prediction (DeepSeek-V3, section 2.2): ``model.mtp_depth = D`` sequential modules that, at each
position ``i``, predict the tokens after the next one -- ``t[i+1+k]`` at depth ``k = 1..D`` -- keeping the causal
chain complete at every depth.

The math, for a sequence ``t[0..T]`` (inputs ``t[0..T-1]``, next-token targets ``t[1..T]``)::

    h0[i]    = RMSNorm_final(h_L[i])                                   the main model's output representation
    x[i]     = W_k [ enorm_k(Emb(t[i+k])) ; hnorm_k(h{k-1}[i]) ]       W_k = eh_proj: [d, 2d], no bias
    hk[i]    = norm_k(Block_k(x)[i])                                   one block of the model's kind, its own norm
    P_k[i]   = softmax(Out(hk[i]))                                     predicts t[i+1+k]
    L_k      = mean over trained i of  -log P_k[i][t[i+1+k]]
    loss     = L_main + mtp_weight * (L_1 + ... + L_D) / D

``Emb`` is the model's own embedding (:meth:`~trickles.models.transformer.Transformer.embed_tokens`, with its scale,
learned positions -- those of ``t[i+k]`` -- and dropout) and ``Out`` its output projection: both shared. ``Block_k``
attends causally over the positions ``i`` with the model's rotary tables and document mask. Which representation
feeds the next depth follows Megatron-Core's ``multi_token_prediction.py`` and the engines that serve DeepSeek-V3's
released MTP weights (vLLM, SGLang): ``h0`` is the main model's hidden state *after* its final norm (what the output
projection reads), and each depth hands on its output after its own norm ``norm_k``. The concatenation puts the
embedding first, as the released ``eh_proj`` weights and Megatron-Core do (the paper writes ``[h; Emb]``).

A position is trained at depth ``k`` when ``t[i+1+k]`` exists (``i + k < T``: the last ``k`` positions of a sequence
are not), its target is trained at all (``-100`` in the main targets stays ignored: chat data's prompt tokens), and,
with packed documents, ``t[i+k]`` lies in the document of ``t[i]``. ``L_k`` is the mean over those positions (0 when
there are none).

The modules train only. In eval mode, or without targets, the model's forward computes the main path alone; a
speculative-decoding proposer can ask :func:`depth_logits` for the depths' logits. Parameter names follow the
Hugging Face layout of DeepSeek-V3's MTP layers (``model.layers.{n_layers + k - 1}.*``, :data:`HF_NAMES`):
``mtp.{k-1}.enorm``, ``.hnorm``, ``.eh_proj``, ``.norm`` (``shared_head.norm``) and ``.block.*`` (the block's own
weights under the model's block names).

Parallel layouts (:mod:`trickles.parallel.tensor.plan`, :mod:`trickles.parallel.pipeline.stages`): under tensor
parallelism the block is split like every other block; ``enorm``, ``hnorm`` and ``eh_proj`` are *replicated* (no
collective in forward; with sequence parallelism each rank runs them on its sequence shard and their gradients are
summed over the tensor-parallel group, like the other norms outside a region), ``norm_k`` enters the region before
the vocabulary-parallel output projection as the final norm does (copy, or all-gather of the sequence), and the
representation handed to the next depth is taken before that entry (:func:`plain`). With pipeline stages the modules
live on the last stage, which also keeps a copy of the embedding (tied across the first and last stage, as a tied
output projection is) and reads the micro-batch's input ids.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection

import torch
from torch import nn

from ..kernels.cross_entropy import IGNORE_INDEX, softcap
from .hf_names import Entry

#: our parameter name under ``mtp.{k-1}.`` -> DeepSeek-V3's under ``model.layers.{n_layers + k - 1}.`` (the block's
#: own weights keep the family's block names)
HF_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
#: DeepSeek-V3's copy of the output projection inside each MTP layer (the model's own ``lm_head`` is the one used)
HF_SHARED_HEAD = "shared_head.head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MTPLayer(nn.Module):
    """Depth ``k``'s module: ``enorm``, ``hnorm``, ``eh_proj`` ``[d, 2d]``, one block of the model's kind and the norm
    before the shared output projection (module docstring)."""

    def __init__(self, d_model: int, make_norm: Callable[[], nn.Module], block: nn.Module):
        super().__init__()
        self.enorm = make_norm()
        self.hnorm = make_norm()
        self.eh_proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = block
        self.norm = make_norm()

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope, labels=None, **extra) -> torch.Tensor:
        """``h [B, T, d]``: the previous depth's representation; ``emb [B, T, d]``: the embeddings of the tokens ``k``
        places ahead. Returns the block's output before ``norm`` (``extra``: the block's masks)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.block(x, rope, None, 0, labels, **extra)


def plain(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm``'s own computation, without the hooks a parallel plan puts on its output (the tensor-parallel region
    entry): the representation a next depth reads sits outside the region."""
    return norm.forward(x)


def shift(t: torch.Tensor, k: int, fill) -> torch.Tensor:
    """``t [B, T, ...]`` moved ``k`` places left along dim 1, the last ``k`` places set to ``fill``."""
    out, n = torch.full_like(t, fill), max(t.shape[1] - k, 0)
    out[:, :n] = t[:, k : k + n]
    return out


def depth_targets(target: torch.Tensor, k: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Depth ``k``'s targets: ``target [B, T]`` moved ``k`` places left, ``-100`` where ``t[i+1+k]`` is past the
    sequence or, with ``documents [B, T]`` (document ids), where ``t[i+k]`` is in another document than ``t[i]``."""
    y = shift(target, k, IGNORE_INDEX)
    if documents is not None:
        d = documents.to(target.device)
        same, n = torch.zeros_like(d, dtype=torch.bool), max(d.shape[1] - k, 0)
        same[:, :n] = d[:, k : k + n] == d[:, :n]
        y = y.masked_fill(~same, IGNORE_INDEX)
    return y


def _embed(model, tokens: torch.Tensor, k: int, start: int, positions: torch.Tensor | None) -> torch.Tensor:
    """The shared embedding of the tokens ``k`` places ahead, at their own positions (learned positions only read
    them; the last ``k`` places, never trained, repeat the last position)."""
    t, ahead = tokens.shape[1], shift(tokens, k, 0)
    if model.pos_embed is None:
        return model.embed_tokens(ahead, start)
    if positions is None:
        positions = torch.arange(start, start + t, device=tokens.device)[None].expand(tokens.shape[0], t)
    pos = shift(positions, k, 0)
    pos[:, t - k :] = positions[:, -1:]
    return model.embed_tokens(ahead, start, pos, model.cfg.max_seq_len)


def depth_states(model, h: torch.Tensor, tokens: torch.Tensor, rope, start=0, positions=None, labels=None, **extra):
    """Yields ``(k, layer_k, out_k)`` for ``k = 1..D``: depth ``k``'s module and its block's output before its norm,
    from the main model's last hidden states ``h [B, T, d]`` (before the final norm) and input ids ``tokens [B, T]``."""
    rep = plain(model.norm, h)
    layers = list(model.mtp.values())
    for k, layer in enumerate(layers, start=1):
        out = layer(rep, _embed(model, tokens, k, start, positions), rope, labels, **extra)
        yield k, layer, out
        if k < len(layers):
            rep = plain(layer.norm, out)


def mtp_loss(model, h, tokens, target, rope, positions=None, labels=None, doc_ids=None, **extra) -> torch.Tensor:
    """``model.mtp_weight`` times the mean over the depths of their mean token cross-entropy (module docstring), from
    the main model's last hidden states ``h [B, T, d]`` (before the final norm), its input ids and next-token targets
    ``[B, T]``. ``doc_ids [B, T]``: packed documents' ids (``extra`` carries their mask for the blocks)."""
    total = 0.0
    for k, layer, out in depth_states(model, h, tokens, rope, 0, positions, labels, **extra):
        total = total + model.loss(layer.norm(out), model.output, depth_targets(target, k, doc_ids))
    return total * (model.cfg.mtp_weight / len(model.mtp))


@torch.no_grad()
def depth_logits(model, tokens: torch.Tensor, depth: int | None = None) -> list[torch.Tensor]:
    """The logits ``[B, T, V]`` of depths ``1..depth`` (all: ``model.cfg.mtp_depth``) for ``tokens [B, T]`` on a
    single-device model: depth ``k``'s row ``i`` predicts ``t[i+1+k]`` from ``t[0..i+k]`` (its last ``k`` rows read
    past the sequence). A speculative-decoding proposer's draft."""
    if model.mtp is None:
        raise ValueError("the model has no multi-token prediction modules (model.mtp_depth = 0)")
    depth = len(model.mtp) if depth is None else depth
    h = model.embed_tokens(tokens)
    rope = model.rope(0, tokens.shape[1])
    for block in model.layers.values():
        h = block(h, rope)
    out = []
    for k, layer, x in depth_states(model, h, tokens, rope):
        out.append(softcap(model.output(layer.norm(x)), model.cfg.final_softcap))
        if k == depth:
            break
    return out


def hf_depth(cfg, found: Collection[str]) -> int:
    """How many multi-token prediction layers a Hugging Face checkpoint of ``cfg`` holds (``found``: its tensor
    names): the layers ``n_layers, n_layers + 1, ...`` that have an ``eh_proj``."""
    k = 0
    while f"model.layers.{cfg.n_layers + k}.eh_proj.weight" in found:
        k += 1
    return k


def hf_entries(cfg, weight_map: Callable, found: Collection[str] = ()) -> list[Entry]:
    """The Hugging Face entries of ``cfg``'s multi-token prediction modules (none without): layer ``n_layers + k - 1``
    holds depth ``k``'s :data:`HF_NAMES` and its block under the family's block names (``weight_map``: the family's,
    called for the model extended by the depths' blocks), and on export (no ``found``) ``shared_head.head``, a copy of
    ``lm_head`` (an import ignores it: :data:`~trickles.models.hf_names.IGNORED`; the model's output projection is
    ``lm_head``)."""
    if not cfg.mtp_depth:
        return []
    n, depth = cfg.n_layers, cfg.mtp_depth
    windows = None if cfg.window_layers is None else [*cfg.window_layers, *cfg.window_layers[-1:] * depth]
    ext = dataclasses.replace(cfg, n_layers=n + depth, mtp_depth=0, window_layers=windows)
    out = []
    for e in weight_map(ext, found):
        m = _LAYER.match(e.hf)
        if m and int(m[1]) >= n:
            k = int(m[1]) - n
            ours = tuple(o.replace(f"layers.{n + k}.", f"mtp.{k}.block.", 1) for o in e.ours)
            out.append(dataclasses.replace(e, ours=ours))
    for k in range(depth):
        hf = f"model.layers.{n + k}."
        out += [Entry(hf + theirs, (f"mtp.{k}.{ours}",)) for ours, theirs in HF_NAMES.items()]
        if not cfg.tied and not found:  # its own storage, not lm_head's (safetensors refuses shared ones): a cat0
            out.append(Entry(hf + HF_SHARED_HEAD, ("output.weight",), "cat0"))
    return out
