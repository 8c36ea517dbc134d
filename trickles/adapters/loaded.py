"""LoRA adapters read from disk for serving, in the served model's terms: :func:`load_adapter`.

Whatever wrote it, an adapter becomes ``{module: (A, B)}`` over the **unfused** trickles linears of the served
model (``layers.0.attn.q_proj``, ``layers.1.mlp.down_proj``; a fused projection's parts by their own names,
:mod:`trickles.models.fused`), ``A [r, in]`` and ``B [out, r]`` in float32 on the CPU, ``B`` already multiplied by
the module's scale ``s``, so the linear ``y = x W^T`` serves ``y + x A^T B^T`` (merged: ``W + B A``).

Two sources (:func:`check_adapter_dir` tells them apart from their JSON alone, before the model loads):

* **PEFT** (``adapter_config.json`` + ``adapter_model.safetensors``): the Hugging Face module ``M`` has
  ``base_model.model.M.lora_A[.<adapter>].weight [r, in]`` and ``...lora_B...weight [out, r]``, and
  ``s = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``), ``r`` and ``alpha`` from ``rank_pattern`` /
  ``alpha_pattern`` where a key matches ``M`` as PEFT matches it (``(.*\\.)?(key)$``, the first key in order), else
  ``r`` / ``lora_alpha``. ``M`` is mapped to our modules by the family's tensor names
  (:func:`~trickles.models.families.weight_map`, the inverse of :mod:`.peft`'s export): ``copy`` and ``conv1d``
  (GPT-2's ``Conv1D``: PEFT's ``A``/``B`` keep the shapes above, ``fan_in_fan_out`` only transposes the merged
  delta) give one module; ``cat0`` / ``fused`` (Phi-3's ``qkv_proj`` = ``[q; k; v]``, GPT-2's ``c_attn``) give
  parts ``p`` with ``out_p`` rows each: ``B``'s rows are cut in that order into ``B_p [out_p, r]`` and every part
  gets the whole ``A``, so ``B_p A`` is the part's rows of ``B A``.
* **A trickles LoRA run** (a checkpoint, a ``checkpoints`` folder or a run's out_dir, ``train.lora_rank > 0``):
  its ``...lora_A.weight`` / ``...lora_B.weight`` parameters (a fused projection's ``qkv_proj.lora_A.q_proj.weight``
  named by its part, :func:`~.lora.part_name`), read alone from the checkpoint's pieces, ``s`` the run's
  (:func:`~trickles.train.load.run_lora`); the run's model must have the served model's tensor shapes.

Refused in one line each, before any tensor is used: other PEFT types, DoRA, trained biases, saved or token
modules, embedding adapters, weights only in ``adapter_model.bin``, a module that is no linear of ours (experts,
norms, a tied output), shapes that do not fit the served model, an ``A`` without its ``B``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..models.config import HOW_KEYS, ModelConfig
from ..models.families import weight_map
from ..models.transformer import Transformer
from ..train import checkpoint as ckpt
from ..train.load import run_lora
from ..train.pieces import PieceReader
from .lora import is_adapter, part_name
from .peft import CONFIG, PREFIX, WEIGHTS

#: PEFT config fields that change what the adapter computes beyond ``B A``: must be off (false, empty or null)
REFUSED = {
    "use_dora": "DoRA is not served; merge it into the model (merge_and_unload) or train a plain LoRA adapter",
    "lora_bias": "trained lora_B biases are not served; train with lora_bias=false",
    "modules_to_save": "fully trained modules are not served; train the adapter with modules_to_save=null",
    "trainable_token_indices": "trained token embeddings are not served; train without trainable_token_indices",
    "layer_replication": "replicated layers are not served; train without layer_replication",
    "alora_invocation_tokens": "activated LoRA is not served; train a plain LoRA adapter",
    "target_parameters": "adapters on bare parameters (experts) are not served; target linear modules",
}
TENSOR = re.compile(r"^(.+)\.lora_(A|B)(?:\.[^.]+)?\.weight$")


@dataclass
class LoadedAdapter:
    """A LoRA adapter read from disk, in the served model's terms."""

    name: str  #: the name requests choose it by
    path: str  #: where it was read from
    #: unfused trickles module name -> (A [r, in], B [out, r]), float32 on the CPU, B times the module's scale s
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        """The largest ``r`` over its modules."""
        return max(a.shape[0] for a, _ in self.weights.values())


def _peft_config(path: str) -> dict:
    """The checked ``adapter_config.json`` of the PEFT directory ``path`` (one-line errors)."""
    file = os.path.join(path, CONFIG)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"adapter {path}: cannot read {file} ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ConfigError(f"adapter {path}: peft_type {kind!r} is not served; give a LoRA adapter (peft_type LORA)")
    for key, why in REFUSED.items():
        if config.get(key):
            raise ConfigError(f"adapter {path}: {CONFIG} sets {key}={config[key]!r}; {why}")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"adapter {path}: bias={config['bias']!r} trains biases, which are not served; use 'none'")
    if not os.path.isfile(os.path.join(path, WEIGHTS)):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise CheckpointError(
                f"adapter {path} holds adapter_model.bin only; convert it to safetensors "
                "(PeftModel.from_pretrained(...).save_pretrained(dir, safe_serialization=True))"
            )
        raise CheckpointError(f"adapter {path} has {CONFIG} but no {WEIGHTS}; it is incomplete")
    return config


def check_adapter_dir(path: str) -> str:
    """``"peft"`` or ``"run"``: what kind of adapter directory ``path`` is, from its JSON files only (a run's out_dir
    is resolved to its newest checkpoint that passes its manifest, :func:`~trickles.train.checkpoint.resolve`); a
    one-line ConfigError / CheckpointError for anything else or for an adapter that cannot be served (module doc)."""
    if os.path.isfile(os.path.join(path, CONFIG)):
        _peft_config(path)
        return "peft"
    meta = _run_meta(path)
    if meta is None:
        raise CheckpointError(
            f"adapter {path} is neither a PEFT adapter directory ({CONFIG} and {WEIGHTS}) nor a trickles LoRA run "
            "(a checkpoint or a run's out_dir)"
        )
    if run_lora(meta[1]) is None:
        raise ConfigError(
            f"adapter {path} is a trickles run without adapters (train.lora_rank=0); serve it as a model, or give a "
            "LoRA run or a PEFT adapter directory"
        )
    return "run"


def _run_meta(path: str) -> tuple[str, dict] | None:
    """``(checkpoint directory, its trainer.json)`` of the trickles run at ``path`` (None: not a checkpoint)."""
    if not os.path.isdir(path):
        return None
    try:
        root = ckpt.resolve(path)
    except CheckpointError:
        return None
    return root, ckpt.read_json(os.path.join(root, "trainer.json"))


def load_adapter(path: str, cfg: ModelConfig, name: str) -> LoadedAdapter:
    """The adapter at ``path`` (a PEFT directory or a trickles LoRA run) for a served model of ``cfg``, chosen by
    requests as ``name`` (module doc for the math and what is refused)."""
    shapes = linear_shapes(cfg)
    if check_adapter_dir(path) == "peft":
        weights = _read_peft(path, cfg, shapes)
    else:
        weights = _read_run(path, cfg, shapes)
    if not weights:
        raise CheckpointError(f"adapter {path} holds no LoRA weights")
    return LoadedAdapter(name, path, weights)


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``{module: (out, in)}`` of every plain linear of a model of ``cfg``, fused projections by their parts."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg, fused_proj=False))
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if type(m) is nn.Linear}


def _pattern(patterns: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the value of the first key of ``patterns`` matching the end of ``module``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_peft(path: str, cfg: ModelConfig, shapes: dict) -> dict:
    config = _peft_config(path)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(os.path.join(path, WEIGHTS)).items():
        m = TENSOR.match(key)
        if not key.startswith(PREFIX) or m is None:
            what = "an embedding adapter" if "lora_embedding_" in key else "no LoRA A or B weight of a linear"
            raise ConfigError(f"adapter {path}: tensor {key} is {what}, which is not served; adapt linear modules only")
        found.setdefault(m.group(1)[len(PREFIX) :], {})[m.group(2)] = t
    hf = weight_map(cfg, {m + ".weight" for m in found})
    entries = {e.hf[: -len(".weight")]: e for e in hf if e.hf.endswith(".weight")}
    rslora = bool(config.get("use_rslora"))
    weights = {}
    for module, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            have, lack = ("A", "B") if "A" in ab else ("B", "A")
            raise CheckpointError(f"adapter {path}: {module} has lora_{have} but no lora_{lack}; it is incomplete")
        entry = entries.get(module)
        parts = [p[: -len(".weight")] for p in entry.ours] if entry is not None else []
        if (
            entry is None
            or entry.kind not in ("copy", "conv1d", "cat0", "fused")
            or any(p not in shapes for p in parts)
        ):
            raise ConfigError(
                f"adapter {path}: {module} is no linear of this model (experts, norms, embeddings and a tied output "
                "are not served); train the adapter without it"
            )
        r = _pattern(config.get("rank_pattern"), module, config.get("r", 8))
        alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
        a, b = ab["A"].float(), ab["B"].float()
        _check(path, module, a, b, r, [shapes[p] for p in parts])
        s = alpha / (math.sqrt(r) if rslora else r)
        rows = b.split([shapes[p][0] for p in parts])
        weights.update({p: (a.clone(), (s * rows_p).contiguous()) for p, rows_p in zip(parts, rows)})
    return weights


def _check(path: str, module: str, a: torch.Tensor, b: torch.Tensor, r: int, parts: list[tuple[int, int]]) -> None:
    """One line unless ``A [r, in]``, ``B [sum out_p, r]`` fit the served linears ``parts`` (``(out_p, in)``)."""
    want_a, want_b = (r, parts[0][1]), (sum(o for o, _ in parts), r)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise CheckpointError(
            f"adapter {path}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, the served model "
            f"needs {list(want_a)} and {list(want_b)} (r={r}); give an adapter trained on this model"
        )


def _read_run(path: str, cfg: ModelConfig, shapes: dict) -> dict:
    root, meta = _run_meta(path)
    lora = run_lora(meta)
    _same_shapes(path, ModelConfig(**meta["model"]), cfg)
    reader = PieceReader(root, "model")
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key in reader.keys():
        if is_adapter(key):
            module, _, rest = part_name(key).rpartition(".lora_")
            found.setdefault(module, {})[rest[0]] = reader.read(key).float()
    weights = {}
    for module, ab in sorted(found.items()):
        if set(ab) != {"A", "B"} or module not in shapes:
            raise CheckpointError(f"adapter {path}: the run's adapter on {module} does not fit the served model")
        _check(path, module, ab["A"], ab["B"], ab["A"].shape[0], [shapes[module]])
        weights[module] = (ab["A"], (lora.scaling * ab["B"]).contiguous())
    return weights


def _same_shapes(path: str, run: ModelConfig, cfg: ModelConfig) -> None:
    """One line unless the run's model has the served model's parameters and shapes, naming the first that differs
    and the model fields that differ."""
    with torch.device("meta"):
        mine, theirs = (
            {n: list(p.shape) for n, p in Transformer(dataclasses.replace(c, fused_proj=False)).named_parameters()}
            for c in (cfg, run)
        )
    if mine == theirs:
        return
    first = next(n for n in sorted(mine.keys() | theirs.keys()) if mine.get(n) != theirs.get(n))
    skip = {*HOW_KEYS, "preset", "from_hf", "family"}
    diff = [
        f"model.{f.name}={getattr(run, f.name)!r} there, {getattr(cfg, f.name)!r} here"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in skip and getattr(run, f.name) != getattr(cfg, f.name)
    ]
    raise CheckpointError(
        f"adapter {path}: the run's model has {first} {theirs.get(first)}, the served model {mine.get(first)} "
        f"({'; '.join(diff[:4])}); serve the adapter on the model the run trained"
    )
