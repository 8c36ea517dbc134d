"""Hugging Face import/export: directories of the families of :mod:`trickles.models.families` (Llama, Mistral,
Qwen2, Qwen3, OLMo 2, Gemma 2, Gemma 3, Phi-3, Mixtral, GPT-2).

A directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). Tensors are read
with safetensors only; nothing is ever unpickled, so ``pytorch_model.bin`` directories are
refused (re-save them with ``save_pretrained(..., safe_serialization=True)``).

:func:`load_hf` (here) reads such a directory into a :class:`~trickles.models.transformer.Transformer`;
:func:`save_hf` (:mod:`trickles.models.hf_export`, imported here) writes one. Each family's tensor names and
``config.json`` mapping, with what is refused and why, are its module's; the shared machinery is
:mod:`trickles.models.hf_names`' and :mod:`trickles.models.hf_config`' (also importable from here).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError, UserError
from . import fused as fusion
from .families import weight_map
from .hf_config import (
    TOKEN_IDS,
    config_from_hf,
    config_to_hf,  # noqa: F401  (re-exported)
)
from .hf_export import save_hf  # noqa: F401  (re-exported: the public pair load_hf / save_hf)
from .hf_names import (
    CONFIG,
    IGNORED,
    INDEX,
    WEIGHTS,
    Entry,
    _as_dtype,
    _hf_shape,
    to_hf,  # noqa: F401  (re-exported)
    to_ours,
)
from .mtp import hf_depth
from .transformer import Transformer


def _tensor_index(root: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """``{tensor name: (file, shape)}`` from the files' headers (no data read)."""
    if (root / WEIGHTS).is_file():
        files = [root / WEIGHTS]
        listed = None
    elif (root / INDEX).is_file():
        try:
            listed = json.loads((root / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{root / INDEX} is not a valid safetensors index ({e!r})") from None
        names = sorted(set(listed.values()))
        bad = [n for n in names if Path(n).name != n]
        if bad:
            raise CheckpointError(f"{root / INDEX} names shard files outside the directory: {bad[:3]}")
        files = [root / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{root / INDEX} lists shard files that do not exist: {missing[:5]}")
    else:
        pickled = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt*"))
        hint = (
            (
                f" It holds {', '.join(pickled[:3])}: pickled weights, which trickles never loads. Re-save it with "
                "model.save_pretrained(path, safe_serialization=True)"
            )
            if pickled
            else ""
        )
        raise CheckpointError(f"{root} has no {WEIGHTS} or {INDEX}.{hint}")
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for k in st.keys():
                    found[k] = (f, tuple(st.get_slice(k).get_shape()))
        except Exception as e:
            raise CheckpointError(f"cannot read {f}: {e}") from None
    if listed is not None:
        absent = [k for k, n in listed.items() if found.get(k, (None,))[0] != root / n]
        if absent:
            raise CheckpointError(f"{root / INDEX} places tensors in shards that do not hold them: {absent[:5]}")
    return found


def _maps_file(entry: Entry, value: torch.Tensor, target: torch.Tensor, own: dict[str, torch.nn.Parameter]) -> bool:
    """Whether the file's tensor ``value`` can be the parameter itself: stored as is (a ``copy`` entry) in the
    parameter's dtype, on the CPU, for a parameter of the model's own (not a part of a fused projection)."""
    return (
        entry.kind == "copy"
        and value.dtype == target.dtype
        and value.device == target.device
        and value.shape == target.shape
        and value.is_contiguous()
        and entry.ours[0] in own
    )


def checkpoint_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a Hugging Face checkpoint holds beside the weights (``{name: buffer}``): the routers'
    ``e_score_correction_bias`` (fp32 in the file and in the model, whatever the weights' type)."""
    return {n: b for n, b in model.named_buffers() if n.endswith(".router.e_score_correction_bias")}


def load_hf(path, dtype=None, device="cpu", fused_proj: bool | None = None) -> Transformer:
    """Reads a Hugging Face directory of a supported family (:mod:`trickles.models.families`) into a
    :class:`Transformer`.

    Parameters are ``dtype`` (default float32, whatever the file holds) on ``device``; ``fused_proj`` sets
    ``model.fused_proj`` (fused q/k/v and gate/up projections, :mod:`trickles.models.fused`). A CPU parameter
    stored in its file as is, in ``dtype``, is not copied: it is the file's memory map, private and copy-on-write
    (as transformers' ``from_pretrained`` loads it), so the files must not be overwritten in place while the model
    lives (replace them by renaming, as :func:`save_hf` does); a parameter that is converted or fused is copied. Raises
    CheckpointError naming the problem: no safetensors weights, an architecture or option this
    model cannot reproduce, missing or unexpected tensors, wrong shapes.
    """
    root = Path(path)
    if not (root / CONFIG).is_file():
        raise CheckpointError(f"{root} is not a Hugging Face model directory: {root / CONFIG} does not exist")
    try:
        raw = json.loads((root / CONFIG).read_text())
    except ValueError as e:
        raise CheckpointError(f"{root / CONFIG} is not valid JSON ({e})") from None
    cfg = dataclasses.replace(config_from_hf(raw, str(root / CONFIG)), fused_proj=fused_proj)
    found = _tensor_index(root)
    cfg = dataclasses.replace(cfg, mtp_depth=hf_depth(cfg, found))  # multi-token prediction layers, where present

    entries = weight_map(cfg, found)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to(dtype=_as_dtype(dtype) or torch.float32).to_empty(device=device)
    for bias in checkpoint_buffers(model).values():  # fp32 whatever the weights' type (Router's contract)
        bias.data = bias.data.float()
    model.reset_buffers()
    # the Hugging Face tensors map to the unfused parts; a fused projection is put together after reading them
    params = fusion.split_state(cfg, {n: p.detach() for n, p in model.named_parameters()})
    params.update(checkpoint_buffers(model))  # the routing biases: read like weights, kept in fp32
    covered = {n for e in entries for n in e.ours}
    if covered != set(params):  # a bug in weight_map, not in the checkpoint
        raise RuntimeError(f"weight_map does not cover the model: {sorted(covered ^ set(params))}")

    expected = {e.hf for e in entries}
    tied_head = cfg.tied and "lm_head.weight" in found
    missing = sorted(expected - set(found))
    unexpected = sorted(
        k for k in found if k not in expected and not IGNORED.search(k) and not (tied_head and k == "lm_head.weight")
    )
    if missing or unexpected:
        raise CheckpointError(
            f"{root} does not match its {CONFIG} ({cfg.family}, {cfg.n_layers} layers): "
            f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    for e in entries:
        file, shape = found[e.hf]
        want = _hf_shape(e, [tuple(params[n].shape) for n in e.ours])
        if shape != want:
            raise CheckpointError(f"{file}: {e.hf} has shape {list(shape)}, but {CONFIG} implies {list(want)}")

    own = dict(model.named_parameters())
    by_file: dict[Path, list[Entry]] = {}
    for e in entries:
        by_file.setdefault(found[e.hf][0], []).append(e)
    with torch.no_grad():
        for file, group in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as st:
                    for e in group:
                        t = st.get_tensor(e.hf)
                        if not t.is_floating_point():
                            raise CheckpointError(
                                f"{file}: {e.hf} is stored as {t.dtype}; only floating-point weights can be loaded"
                            )
                        dim = 1 if e.kind == "cat1" else 0
                        for name, value in zip(e.ours, to_ours(e, t, [params[n].shape[dim] for n in e.ours])):
                            if _maps_file(e, value, params[name], own):
                                own[name].data = value  # the file's pages themselves, copy-on-write: no copy
                            else:
                                (params[name][e.index] if e.kind == "expert" else params[name]).copy_(value)
            except UserError:
                raise
            except Exception as err:
                raise CheckpointError(f"cannot read {file}: {err}") from None
        if tied_head:
            file = found["lm_head.weight"][0]
            with safe_open(str(file), framework="pt", device="cpu") as st:
                head = st.get_tensor("lm_head.weight")
            if head.shape != model.embed.weight.shape or not torch.equal(
                head.to(model.embed.weight), model.embed.weight
            ):
                raise CheckpointError(
                    f"{root}: tie_word_embeddings is true but lm_head.weight differs from the "
                    "token embedding; set tie_word_embeddings to false in config.json"
                )
        for name, value in fusion.fuse_state(cfg, params).items():
            if fusion.layout_of(cfg, name) is not None:
                own[name].copy_(value)
    model.hf_token_ids = {k: raw.get(k) for k in TOKEN_IDS}
    return model
