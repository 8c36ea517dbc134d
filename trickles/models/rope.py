"""Rotary position embeddings: the cos/sin tables of each rope type, and their Hugging Face fields both ways.

A rope type only changes the inverse frequencies ``inv_freq[i]`` (``i < head_dim / 2``) and, for yarn, multiplies cos
and sin by an attention factor. The tables stay ``[length, head_dim]`` buffers (each frequency for both halves,
rotate-half convention), so every layout that indexes them (tensor, pipeline and context parallel, the KV cache, the
paged engine) rotates the same way. With ``base_i = theta ** (2i / head_dim)``:

* ``default``: ``inv_freq = 1 / base_i``.
* ``linear``: ``inv_freq = 1 / (factor * base_i)`` (positions divided by ``factor``).
* ``llama3`` (Llama 3.1): with ``L = original_max_positions`` and wavelength ``w = 2 pi base_i``, a ``w`` above
  ``L / low_freq_factor`` is divided by ``factor``, one below ``L / high_freq_factor`` is kept, and between them
  ``s = (L / w - low) / (high - low)`` blends ``(1 - s) inv / factor + s inv``.
* ``yarn`` (YaRN, arXiv:2309.00071): dimension ``d`` turns ``L / (2 pi base_d)`` times in the original context;
  the dimensions between those turning ``beta_fast`` and ``beta_slow`` times (``floor``/``ceil`` with
  ``truncate``, clipped to ``[0, head_dim - 1]``) ramp linearly from kept (fast) to divided by ``factor`` (slow).
  cos and sin are multiplied by ``attention_factor``, by default ``0.1 ln(factor) + 1`` (1 for ``factor <= 1``), or
  with ``mscale`` and ``mscale_all_dim`` both set, that formula with ``0.1 * mscale`` over it with
  ``0.1 * mscale_all_dim``.

The settings are a :class:`RopeScaling` (a model's: ``RopeScaling.of(cfg)``, from ``model.rope_type`` and the
``model.rope_*`` fields, which :meth:`RopeScaling.check` validates when the config is). These are transformers'
formulas (``modeling_rope_utils``), computed in fp32 the same way, so the tables agree to rounding. ``dynamic``
(frequencies that change with the sequence length) and ``longrope`` (per-dimension factor lists) are refused on
import.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ..errors import CheckpointError, ConfigError

RopeType = Literal["default", "linear", "llama3", "yarn"]
#: the rope types trickles builds
ROPE_TYPES = get_args(RopeType)
#: the :class:`RopeScaling` fields (``model.rope_<name>``) each scaled type reads; the others keep their defaults
READS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"),
    "yarn": ("factor", "original_max_positions", "beta_fast", "beta_slow")
    + ("attention_factor", "mscale", "mscale_all_dim", "truncate"),
}
#: Hugging Face ``rope_parameters`` key -> :class:`RopeScaling` field
HF_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_positions",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "truncate": "truncate",
}
_UNSUPPORTED = {
    "dynamic": "its frequencies change with each sequence's length",
    "longrope": "its per-dimension short_factor/long_factor lists",
}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are scaled: ``model.rope_type`` (``type``) and the ``model.rope_<name>`` fields
    (documented there), defaults equal. ``original_max_positions`` None means the model's ``max_seq_len``."""

    type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def of(cls, cfg) -> RopeScaling:
        """The scaling of a :class:`~trickles.models.config.ModelConfig` (its ``rope_type`` and ``rope_*`` fields),
        ``original_max_positions`` resolved to ``max_seq_len`` for the types that read it."""
        values = {f.name: getattr(cfg, f"rope_{f.name}") for f in dataclasses.fields(cls)}
        if values["original_max_positions"] is None and "original_max_positions" in READS.get(cfg.rope_type, ()):
            values["original_max_positions"] = cfg.max_seq_len
        return cls(**values)

    def check(self, theta: float, flavor: str = "llama") -> None:
        """Raises ConfigError, naming the ``model.rope_*`` field, for a scaling that cannot be built or a field its
        type would ignore."""
        if self.type not in READS:
            raise ConfigError(f"model.rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.type!r}")
        reads, default = READS[self.type], RopeScaling()
        for f in dataclasses.fields(self):
            if f.name not in reads and f.name != "type" and getattr(self, f.name) != getattr(default, f.name):
                raise ConfigError(f"model.rope_{f.name} has no effect with model.rope_type={self.type}; leave it unset")
        if self.type != "default" and flavor != "llama":
            raise ConfigError(f"model.rope_type={self.type} needs rotary embeddings (flavor llama), not {flavor}")
        checked = {"theta": theta, **{n: getattr(self, n) for n in reads if n not in ("mscale", "mscale_all_dim")}}
        for name, value in checked.items():
            if value is not None and not isinstance(value, bool) and not value > 0:
                raise ConfigError(f"model.rope_{name} must be greater than 0, got {value}")
        low, high = self.low_freq_factor, self.high_freq_factor
        if self.type == "llama3" and not high > low:
            raise ConfigError(f"model.rope_high_freq_factor ({high}) must be greater than rope_low_freq_factor ({low})")
        if self.type == "yarn" and (self.beta_fast < self.beta_slow or theta == 1):
            raise ConfigError(
                f"yarn needs model.rope_beta_fast ({self.beta_fast}) >= rope_beta_slow ({self.beta_slow}) and "
                f"model.rope_theta ({theta}) other than 1"
            )

    @property
    def attention(self) -> float:
        """What cos and sin are multiplied by: yarn's attention factor, 1 for the other types."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    @property
    def context(self) -> int:
        """The pretraining context llama3 and yarn scale from."""
        if self.original_max_positions is None:
            raise ConfigError(f"model.rope_type={self.type} needs model.rope_original_max_positions or max_seq_len")
        return self.original_max_positions


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    factor, low, high, context = s.factor, s.low_freq_factor, s.high_freq_factor, s.context
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > context / low, inv / factor, inv)
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    between = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(between, blended, scaled)


def _yarn(base: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    context = s.context

    def dimension(rotations: float) -> float:  # the (fractional) dimension turning `rotations` times in `context`
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1).to(base.device)
    kept = 1 - ramp  # 1: the original frequency, 0: divided by factor
    return 1.0 / (s.factor * base) * (1 - kept) + 1.0 / base * kept


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None, device=None) -> torch.Tensor:
    """``inv_freq [head_dim / 2]`` (fp32) of base ``theta``, scaled by ``scaling`` (None: default)."""
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    kind = "default" if scaling is None else scaling.type
    if kind == "yarn":
        return _yarn(base, head_dim, theta, scaling)
    inv = 1.0 / base
    if kind == "linear":
        return inv / scaling.factor
    if kind == "llama3":
        return _llama3(inv, scaling)
    if kind != "default":
        raise ConfigError(f"model.rope_type must be one of {', '.join(ROPE_TYPES)}, got {kind!r}")
    return inv


def rope_tables(
    head_dim: int, length: int, theta: float, device=None, scaling: RopeScaling | None = None, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[length - start, head_dim]`` (each frequency repeated for both halves) for
    positions ``start..length-1``, scaled by ``scaling`` (None: default; a model's is ``RopeScaling.of(cfg)``) and
    multiplied by its attention factor. ``theta`` and ``head_dim`` are given apart from it, so a layer can have a base
    of its own. A row does not depend on which rows are computed with it."""
    inv = inverse_frequencies(head_dim, theta, scaling, device)
    freqs = torch.outer(torch.arange(start, length, dtype=torch.float32, device=device), inv)
    # cos and sin of each frequency once, then repeated for both halves (the same values as of the repeated
    # frequencies, at half the transcendental work: a 128k-position table is a noticeable part of a model's build)
    cos, sin = freqs.cos(), freqs.sin()
    scale = 1.0 if scaling is None else scaling.attention
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


# ---- Hugging Face config.json ------------------------------------------------------------


def _number(value, where: str, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (integer and value != int(value)):
        raise CheckpointError(f"{where}={value!r} must be {'an integer' if integer else 'a number'}")
    return int(value) if integer else float(value)


def rope_fields_from_hf(raw: dict, source: str, default_theta: float = 10000.0) -> dict:
    """The ``ModelConfig`` rotary fields (``rope_theta``, ``rope_type`` and the ``rope_*`` its type reads) of a
    Hugging Face config dict: transformers 4.x (``rope_theta``, ``rope_scaling``) or 5.x (``rope_parameters``).

    Keys a type leaves out take transformers' defaults (``original_max_position_embeddings``:
    ``max_position_embeddings``; yarn's ``factor``: their ratio). Raises CheckpointError, one line starting with
    ``source`` and naming the field: a rope type that is not built (``dynamic``, ``longrope``, unknown ones),
    ``partial_rotary_factor``, per-layer rope parameters, a ``rope_theta`` the two versions would read differently,
    a missing key or a value :meth:`RopeScaling.check` refuses."""
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(field) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError(f"{source}: {field} {params!r} is not one flat dict (per-layer rope is not supported)")
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ROPE_TYPES:
        why = f" ({_UNSUPPORTED[kind]})" if kind in _UNSUPPORTED else ""
        raise CheckpointError(
            f"{source}: {field}.rope_type={kind!r} is not supported{why}; trickles builds {', '.join(ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(
            f"{source}: partial_rotary_factor={partial} is not supported (trickles rotates whole heads)"
        )
    top, inner = raw.get("rope_theta"), params.get("rope_theta")
    if top is not None and inner is not None and float(top) != float(inner):
        raise CheckpointError(
            f"{source}: rope_theta={top} disagrees with {field}.rope_theta={inner}; "
            "transformers 4.x and 5.x would read different models, fix one of them"
        )
    theta = _number(inner if inner is not None else top if top is not None else default_theta, f"{source}: rope_theta")
    hf = {key: params.get(key) for key, name in HF_KEYS.items() if name in READS[kind]}
    if "original_max_position_embeddings" in hf and hf["original_max_position_embeddings"] is None:
        hf["original_max_position_embeddings"] = raw.get("max_position_embeddings")
    if kind == "yarn":
        if hf["factor"] is None and hf["original_max_position_embeddings"] and raw.get("max_position_embeddings"):
            hf["factor"] = raw["max_position_embeddings"] / hf["original_max_position_embeddings"]
        hf["beta_fast"] = hf["beta_fast"] or 32.0  # transformers' `or`: a 0 takes the default too
        hf["beta_slow"] = hf["beta_slow"] or 1.0
        hf["truncate"] = True if hf["truncate"] is None else hf["truncate"]
    values = {}
    for key, value in hf.items():
        where = f"{source}: {field}.{key}"
        if value is None and key not in ("attention_factor", "mscale", "mscale_all_dim"):
            raise CheckpointError(f"{where} is missing; rope_type={kind!r} needs it")
        if key == "truncate" and not isinstance(value, bool):
            raise CheckpointError(f"{where}={value!r} must be true or false")
        if value is not None and key != "truncate":
            value = _number(value, where, integer=key == "original_max_position_embeddings")
        values[HF_KEYS[key]] = value
    try:
        RopeScaling(kind, **values).check(theta)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {field} {params}: {e}") from None
    return {"rope_theta": theta, "rope_type": kind, **{f"rope_{k}": v for k, v in values.items() if v is not None}}


def rope_fields_to_hf(cfg) -> dict:
    """The ``config.json`` keys of a ``ModelConfig``'s rotary embedding that transformers 4.x and 5.x both read:
    ``rope_theta``, ``rope_scaling`` (4.x; None for the default type) and ``rope_parameters`` (5.x, with
    ``rope_type`` and ``rope_theta``). Every key the type reads is written (defaults included, unset optional ones
    left out)."""
    s = RopeScaling.of(cfg)
    scaling = {"rope_type": s.type}
    scaling.update({key: getattr(s, name) for key, name in HF_KEYS.items() if name in READS[s.type]})
    scaling = {k: v for k, v in scaling.items() if v is not None}
    return {
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if s.type == "default" else scaling,
        "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta},
    }
