"""Pipeline stages: cutting a single-device :class:`~trickles.models.transformer.Transformer` into parts.

The ``n_layers`` blocks are cut into ``S = pp * v`` consecutive parts (virtual stages), as even as
possible by count -- the earlier parts taking the extra layers, e.g. 7 layers on 2 stages as
``[4, 3]`` -- or as ``parallel.pipeline_layers`` lists them. Part ``s`` becomes chunk ``s // pp`` of
pipeline rank ``s % pp`` (see :mod:`trickles.parallel.pipeline.schedules`). The token and position
embeddings go with part 0, the final norm, output projection and loss with part ``S - 1`` -- and the multi-token
prediction modules (``model.mtp_depth``, :mod:`trickles.models.mtp`), which read the micro-batch's input ids there.

:func:`keep_stage` prunes the model, still on the meta device, to what one rank holds, so the
rank only ever allocates and initializes its own stage; parameters keep their global names
(``layers.5.attn.q_proj.weight``), which is what makes initialization, checkpoints and
resharding independent of the layout.

Tied input and output embeddings (gpt2): the last rank keeps the ``embed`` module as the holder of
its copy of the weight, used only by the output projection. The two copies start equal (same
name, same initial value), their gradients are summed over the first and last rank
(``pp_ends`` group) before the data-parallel reduction, so they get the same update and stay
equal, as in Megatron-LM. Multi-token prediction embeds tokens on the last stage: it keeps the embedding (and the
learned positions) there the same way, tied or not.

Messages (:func:`send_bytes`): every micro-batch's activation leaves each virtual stage but the last
(``pp`` group) and its gradient each virtual stage but the first (``pp_grad``), one tensor of the
stage's output shape each: ``[B, T, d]`` in the compute type, with sequence parallelism
``[B, T / tp, d]``, on a tensor-parallel grid ``B T d / tp`` elements, under context parallelism
``T / cp`` tokens.
"""

from __future__ import annotations

from itertools import chain

import torch

from ...errors import ConfigError
from ...models.kv_cache import KVCache
from ...models.mtp import mtp_loss
from ...models.transformer import Transformer
from .schedules import Shape


def partition_layers(n_layers: int, parts: int, given: list[int] | None = None) -> list[list[int]]:
    """The layer indices of each of ``parts`` consecutive parts (``given``: their sizes)."""
    if given:
        if len(given) != parts:
            raise ConfigError(
                f"parallel.pipeline_layers lists {len(given)} stages, but parallel.pp x parallel.virtual_stages "
                f"= {parts}; give one layer count per (virtual) stage"
            )
        if any(n < 1 for n in given) or sum(given) != n_layers:
            raise ConfigError(
                f"parallel.pipeline_layers {list(given)} must be positive counts adding up to model.n_layers "
                f"({n_layers})"
            )
        sizes = list(given)
    else:
        if n_layers < parts:
            raise ConfigError(
                f"model.n_layers ({n_layers}) is smaller than the number of pipeline stages (parallel.pp x "
                f"parallel.virtual_stages = {parts}); every stage needs at least one layer: lower parallel.pp "
                f"or parallel.virtual_stages, or add layers"
            )
        base, extra = divmod(n_layers, parts)
        sizes = [base + (1 if s < extra else 0) for s in range(parts)]
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


class StageChunk:
    """One model chunk of a rank: some consecutive layers, perhaps with the embedding or the head.

    Not a module: it runs parts of the rank's (pruned) model, which owns the parameters.
    ``first``: it starts from token ids (virtual stage 0); ``last``: it ends with logits.
    """

    def __init__(self, model: Transformer, layers: list[int], first: bool, last: bool):
        self.model, self.layers, self.first, self.last = model, layers, first, last

    def __call__(
        self,
        inp: torch.Tensor,
        seq_len: int,
        cache: KVCache | None = None,
        start: int = 0,
        labels: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids ``[B, T]`` (first chunk) or hidden states in; hidden states or, from the last chunk, logits
        (the mean token cross-entropy when ``target`` is given) out. ``labels``: the micro-batch's label ids
        (hard-routed experts); ``documents``: its document ids (packed documents: every chunk builds the mask and
        positions from them, as :meth:`Transformer.forward` does); ``tokens``: its input ids, which the last chunk's
        multi-token prediction reads in training (its loss added as :meth:`Transformer.forward` adds it)."""
        m = self.model
        extra, positions = {}, None
        if documents is not None:
            mask = extra["documents"] = m.document_mask(documents, inp.device)
            positions = mask.positions
        h = inp
        if self.first:
            h = (
                m.embed_tokens(inp, start)
                if positions is None
                else m.embed_tokens(inp, start, positions, documents.shape[1])
            )
        rope = m.rope(start, seq_len) if positions is None else m.rope(start, seq_len, positions)
        for i in self.layers:
            h = m.layers[str(i)](h, rope, cache, start, labels, **extra)
        if not self.last:
            return h
        if m.mtp is None or target is None or not m.training:
            return m.head(h, target)
        return m.head(h, target) + mtp_loss(m, h, tokens, target, rope, positions, labels, documents, **extra)

    def __repr__(self) -> str:
        ends = (
            ("embedding + " if self.first else "")
            + f"layers {self.layers[0]}-{self.layers[-1]}"
            + (" + head" if self.last else "")
        )
        return f"StageChunk({ends})"


def keep_stage(model: Transformer, rank: int, shape: Shape, parts: list[list[int]]) -> list[StageChunk]:
    """Prunes ``model`` (in place) to pipeline rank ``rank``'s chunks; returns them in chunk order."""
    owned = [parts[shape.stage(rank, c)] for c in range(shape.v)]
    keep = set(chain.from_iterable(owned))
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    first, last = shape.ends(rank)
    embeds = last and model.mtp is not None  # multi-token prediction embeds tokens on the last stage
    if not first:
        if not embeds:
            model.pos_embed = None
        if not (last and model.cfg.tied) and not embeds:
            model.embed = None
    if not last:
        model.norm = None
        model.output = None
        model.mtp = None
    stages = [shape.stage(rank, c) for c in range(shape.v)]
    return [StageChunk(model, owned[c], stages[c] == 0, stages[c] == shape.stages - 1) for c in range(shape.v)]


def tied_parameters(model: Transformer, rank: int, shape: Shape) -> list[torch.nn.Parameter]:
    """The weights this rank shares with another stage: the tied embedding on the first and last rank, when they
    differ (ZB-V holds both ends on rank 0); with multi-token prediction the embedding and learned positions."""
    first, last = shape.ends(rank)
    if shape.p == 1 or not (model.cfg.tied or model.cfg.mtp_depth) or first == last:
        return []
    if not model.cfg.mtp_depth:
        return [model.embed.weight]
    return [model.embed.weight] + ([] if model.pos_embed is None else [model.pos_embed.weight])


def reused_parameters(model: Transformer, rank: int, shape: Shape) -> list[torch.nn.Parameter]:
    """The weights two chunks of this rank both use: the tied embedding where the rank holds the first and the last
    stage (ZB-V's rank 0), whose gradient is complete only after both chunks' last backward."""
    first, last = shape.ends(rank)
    return [model.embed.weight] if model.cfg.tied and first and last and shape.stages > 1 else []


def send_bytes(shape: Shape, rank: int, message_bytes: int) -> tuple[int, int]:
    """``(activations, gradients)``: bytes pipeline rank ``rank`` sends in one step of ``shape`` (``m`` micro-batches
    through its ``v`` chunks), ``message_bytes`` per message (module docstring): ``m x message_bytes`` for each of its
    chunks that is not the last virtual stage (activations) and for each that is not the first (gradients) -- but
    none to a stage of the same rank (ZB-V's turn on the last rank)."""
    stages = [shape.stage(rank, c) for c in range(shape.v)]
    away = lambda s: shape.owner(s)[0] != rank  # noqa: E731
    forward = sum(s < shape.stages - 1 and away(s + 1) for s in stages) * shape.m * message_bytes
    backward = sum(s > 0 and away(s - 1) for s in stages) * shape.m * message_bytes
    return forward, backward
