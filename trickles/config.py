"""The whole run's configuration: one typed section per component, loaded from TOML.

``Config.load("run.toml", ["train.steps=100", "parallel.tp=2"])`` reads the file with the
standard library's ``tomllib``, applies ``--set`` overrides, and checks every value's type.
``Config.validate(world_size)`` then checks the combinations (batch arithmetic, degrees against
the number of processes) and returns the :class:`ParallelDims` to build; it runs before any
process group exists, so a bad configuration never hangs a cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .adapters.lora import check_lora
from .compress.config import DistillConfig
from .config_checks import LayoutChecks
from .data.config import DataConfig
from .errors import ConfigError
from .memory.config import MemoryConfig
from .models.config import HF_RUN_KEYS, HOW_KEYS, ModelConfig
from .models.presets import apply_preset
from .models.transformer import Transformer
from .options import field_docs, section_from_dict, unknown_key_error
from .parallel.config import ParallelConfig
from .topology import ParallelDims
from .train.config import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "memory": MemoryConfig,
    "distill": DistillConfig,
}

#: A run's TOML may also describe the machines it runs on (``[cluster]``, :mod:`trickles.planner.cluster`): kept as
#: given in :attr:`Config.cluster` for the planner (``trickles plan``, ``parallel.elastic``), which checks it.
PLANNER_SECTION = "cluster"


@dataclass
class Config(LayoutChecks):
    """Everything a run needs, section by section."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    #: the ``[cluster]`` table as given (empty: none): the machines, for the planner
    cluster: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.parallel.resolve()  # what the pipeline schedule implies (zb-v: two chunks per rank)

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, tables: dict[str, Any], where: str = "") -> Config:
        """Builds a config from ``{section: {key: value}}``; unknown sections and keys are errors."""
        cfg = cls()
        for section, values in tables.items():
            if section == PLANNER_SECTION:  # the machines, read by trickles.planner.cluster_files.cluster_from_dict
                if not isinstance(values, dict):
                    raise ConfigError(f"{section} must be a table of keys ([{section}]){where}")
                cfg.cluster = dict(values)
                continue
            if section not in SECTIONS:
                raise unknown_key_error(section, SECTIONS, where)
            if not isinstance(values, dict):
                raise ConfigError(f"{section} must be a table of keys ([{section}]){where}")
            values = dict(values)
            base = None
            if section == "model" and values.get("from_hf") is not None:
                base = _shape_from_hf(values, where)
            elif section == "model" and values.get("preset") is not None:
                base = apply_preset(ModelConfig(), str(values.pop("preset")))
            setattr(cfg, section, section_from_dict(SECTIONS[section], values, section, base, where))
        cfg.parallel.resolve()  # what the pipeline schedule implies
        init = cfg.train.init_from
        if init and "tokenizer" not in (tables.get("data") or {}):  # a Hugging Face directory's own tokenizer
            from .train.load import hf_tokenizer_dir, is_hf_dir

            if is_hf_dir(init) and hf_tokenizer_dir(init):
                cfg.data.tokenizer = init
        return cfg

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> Config:
        """Reads ``path`` (TOML; None: the defaults, which are the demo) and applies ``overrides``."""
        tables: dict[str, dict[str, Any]] = {}
        where = ""
        if path is not None:
            where = f" (in {path})"
            try:
                with open(path, "rb") as f:
                    tables = tomllib.load(f)
            except FileNotFoundError:
                raise ConfigError(
                    f"config file {path} does not exist; give the path of a TOML file (see examples/)"
                ) from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for item in overrides:
            key, sep, value = item.partition("=")
            section, dot, name = key.strip().partition(".")
            if not sep or not dot or not name:
                raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100)")
            if section not in SECTIONS:
                raise unknown_key_error(section, SECTIONS, " (in --set)")
            tables.setdefault(section, {})[name] = value.strip()
        return cls.from_dict(tables, where)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        return {**out, PLANNER_SECTION: dict(self.cluster)} if self.cluster else out

    def to_toml(self) -> str:
        """The configuration as a TOML file that :meth:`load` reads back (unset keys commented)."""
        lines = []
        for name, cls in SECTIONS.items():
            lines.append(f"[{name}]")
            docs = field_docs(cls)
            for key, value in dataclasses.asdict(getattr(self, name)).items():
                lines.append(f"# {docs[key]}")
                lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
            lines.append("")
        if self.cluster:  # as given: its scalar keys, then its tables
            tables = {k: v for k, v in self.cluster.items() if isinstance(v, dict)}
            lines += [f"[{PLANNER_SECTION}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in self.cluster.items() if k not in tables]
            for name, table in tables.items():
                lines += ["", f"[{PLANNER_SECTION}.{name}]"]
                lines += [f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in table.items()]
            lines.append("")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    # ---- checks --------------------------------------------------------------------------
    def _check_lora(self, dims: ParallelDims) -> None:
        """LoRA (``train.lora_rank``) trains with the frozen base at the layouts built for it."""
        if not self.train.lora_rank:
            return
        int8 = "train.lora_base=int8" if self.train.lora_base == "int8" else ""
        for bad, what, fix in (
            (dims.tp > 1 and dims.tp_mode != "1d", f"parallel.tp_mode={dims.tp_mode}", "use parallel.tp_mode=1d"),
            (self.train.qat, "train.qat", "set train.qat=false"),
            (bool(self.distill.teacher), "distillation", "unset distill.teacher"),
            (int8 and dims.tp > 1, f"{int8} and parallel.tp={dims.tp}", "use parallel.tp=1, train.lora_base=same"),
            (int8 and self.parallel.zero == 3, f"{int8} and ZeRO-3", "use parallel.zero=2, train.lora_base=same"),
        ):
            if bad:
                raise ConfigError(f"LoRA (train.lora_rank) is not built with {what} yet; {fix} or train.lora_rank=0")
        # the targets and the rank against the model's linears, on the meta device (no memory)
        shape = dataclasses.replace(
            self.model, vocab_size=self.model.vocab_size or 1 << 20, max_seq_len=self.model.max_seq_len or 1
        )
        with torch.device("meta"):
            check_lora(Transformer(shape), self.train.lora())

    def validate(self, world_size: int) -> ParallelDims:
        """Checks every section and the combinations; returns the degrees to build."""
        if self.train.init_from:  # the checkpoint's model shape is the run's (a pruned model's, say)
            from .train.checkpoint import model_config_of
            from .train.load import hf_model_config, is_hf_dir

            init = self.train.init_from
            if is_hf_dir(init):  # a Hugging Face directory: its config.json's shape, how to compute it from ours
                how = {k: getattr(self.model, k) for k in (*HOW_KEYS, *HF_RUN_KEYS)}
                self.model = dataclasses.replace(hf_model_config(init, "train.init_from"), **how)
            else:
                self.model = model_config_of(init, self.model)
        for name in SECTIONS:
            section = getattr(self, name)
            if hasattr(section, "validate"):
                section.validate()
        p = self.parallel
        dims = ParallelDims.infer(
            world_size, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, tp_mode=p.tp_mode, tp_depth=p.tp_depth
        )
        dims.validate(world_size)
        if dims.ep > 1 and not self.model.moe_experts:
            raise ConfigError(
                f"parallel.ep={dims.ep} splits the experts of mixture-of-experts blocks, but model.moe_experts is 0; "
                "set model.moe_experts or parallel.ep=1"
            )
        if dims.ep > 1 and self.model.moe_experts % dims.ep:
            raise ConfigError(
                f"model.moe_experts ({self.model.moe_experts}) must be divisible by parallel.ep ({dims.ep}); "
                f"change one of them"
            )
        if self.model.kernels == "triton":
            import torch

            from .kernels import check_kernels

            wants_cpu = self.train.device == "cpu" or (self.train.device == "auto" and not torch.cuda.is_available())
            check_kernels("triton", torch.device("cpu" if wants_cpu else "cuda"))
        if dims.tp > 1 and dims.tp_mode != "1d":
            self._check_tensor_grid(dims)
        else:
            self._check_tensor_parallel(dims.tp)
        self._check_context_parallel(dims)
        self._check_documents(dims)
        self._check_pipeline(dims)
        self.memory.check_layout(dims, bool(self.model.moe_experts), self.train.compile)
        self.distill.check_layout(dims, self.parallel.zero)
        if self.memory.offload_optimizer and self.parallel.zero == 0:
            raise ConfigError("memory.offload_optimizer needs a sharded optimizer; set parallel.zero to 1, 2 or 3")
        if self.parallel.zero == 3 and self.train.compile:
            raise ConfigError(
                "train.compile does not work with parallel.zero=3 yet (its gather hooks run around each block); "
                "use parallel.zero=2 or train.compile=false"
            )
        self._check_lora(dims)
        self.batch_plan(dims.dp)
        if self.model.max_seq_len is not None and self.model.max_seq_len < self.data.seq_len:
            raise ConfigError(
                f"data.seq_len ({self.data.seq_len}) is longer than model.max_seq_len ({self.model.max_seq_len}); "
                "shorten data.seq_len or raise model.max_seq_len"
            )
        if self.model.vocab_size is not None and self.data.tokenizer == "byte" and self.model.vocab_size < 257:
            raise ConfigError(
                f"model.vocab_size ({self.model.vocab_size}) is smaller than the byte tokenizer's 257 tokens; "
                "raise it or leave it unset"
            )
        return dims

    def _check_documents(self, dims: ParallelDims) -> None:
        """``data.document_mask``: the layouts whose attention or positions do not take document ids yet."""
        if not self.data.document_mask:
            return
        for bad, what, fix in (
            (dims.tp > 1 and dims.tp_mode != "1d", f"parallel.tp_mode={dims.tp_mode}", "use parallel.tp_mode=1d"),
            (bool(self.distill.teacher), "distillation (distill.teacher)", "leave distill.teacher unset"),
        ):
            if bad:
                raise ConfigError(
                    f"data.document_mask=true does not combine with {what} yet; {fix} or set data.document_mask=false"
                )

    def recompute_modes(self, dims: ParallelDims) -> dict[int, str]:
        """Each layer's recomputation on the layout ``dims`` (``memory.recompute_num_layers`` counts the layers of
        each pipeline rank, in the order the rank runs its chunks)."""
        from .parallel.pipeline.schedules import Shape
        from .parallel.pipeline.stages import partition_layers

        n = self.model.n_layers
        if dims.pp == 1 or not self.memory.recompute_num_layers:
            return self.memory.layer_modes([list(range(n))])
        p = self.parallel
        shape = Shape.of(p.schedule, dims.pp, p.virtual_stages, 1)
        parts = partition_layers(n, shape.stages, p.pipeline_layers)
        return self.memory.layer_modes([[i for c in shape.chunks(parts, r) for i in c] for r in range(dims.pp)])

    def batch_plan(self, dp: int) -> tuple[int, int]:
        """``(micro_batch, accumulation)`` with ``global_batch = micro_batch * accumulation * dp``."""
        t = self.train
        if t.global_batch % dp:
            raise ConfigError(
                f"train.global_batch ({t.global_batch}) must be divisible by parallel.dp ({dp}); "
                f"set train.global_batch to a multiple of {dp}"
            )
        micro = t.micro_batch or t.global_batch // dp
        per_rank = t.global_batch // dp
        if per_rank % micro:
            need = micro * dp
            raise ConfigError(
                f"train.global_batch ({t.global_batch}) must equal train.micro_batch ({micro}) x accumulation x "
                f"parallel.dp ({dp}); set train.global_batch to a multiple of {need} or change train.micro_batch"
            )
        return micro, per_rank // micro

    def accumulates(self, dims: ParallelDims) -> bool:
        """Whether a step's gradients add up over several backward passes (micro-batches, or pipeline stages'
        micro-batches)."""
        return self.batch_plan(dims.dp)[1] > 1 or dims.pp > 1


#: model keys that may be given beside ``model.from_hf``: how the model computes and trains, not its shape
FREE_OF_SHAPE = ("from_hf", *HOW_KEYS, *HF_RUN_KEYS, "dropout", "init_std")


def _shape_from_hf(values: dict[str, Any], where: str) -> ModelConfig:
    """``model.from_hf``: the directory's shape (config.json only), which the other keys given must not contradict."""
    from .train.load import hf_model_config

    path = str(values["from_hf"])
    if values.get("preset") is not None:
        raise ConfigError(f"model.from_hf and model.preset both give the model's shape{where}; keep one of them")
    base = dataclasses.replace(hf_model_config(path, "model.from_hf"), from_hf=path)
    given = section_from_dict(ModelConfig, {k: v for k, v in values.items() if k != "preset"}, "model", base, where)
    for key in values:
        if key not in FREE_OF_SHAPE and key != "preset" and getattr(given, key) != getattr(base, key):
            raise ConfigError(
                f"model.{key} = {getattr(given, key)!r} contradicts model.from_hf={path} (its config.json gives "
                f"{getattr(base, key)!r}){where}; leave model.{key} out or model.from_hf unset"
            )
    return base


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (a [[data.sources]] entry); unset keys left out
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    return json.dumps(str(v))


def key_rows() -> list[tuple[str, str, str, Any, str]]:
    """``(section, key, type, default, description)`` for every key, from the section dataclasses.

    The one source of ``trickles config --keys`` (:func:`describe_keys`) and of the configuration
    reference page, docs/configuration.md (:func:`keys_markdown`).
    """
    import typing

    rows = []
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for key, doc in field_docs(cls).items():
            tp = hints[key].__name__ if isinstance(hints[key], type) else str(hints[key]).replace("typing.", "")
            table = (typing.get_args(hints[key]) or [None])[0]
            if not dataclasses.is_dataclass(table):
                rows.append((name, key, tp, getattr(defaults, key), doc))
                continue
            rows.append((name, key, f"list of [[{name}.{key}]] tables", getattr(defaults, key), doc))
            sub_hints, sub_defaults = typing.get_type_hints(table), table()  # each table's keys
            for sub, sub_doc in field_docs(table).items():
                tp = sub_hints[sub].__name__ if isinstance(sub_hints[sub], type) else str(sub_hints[sub])
                rows.append((name, f"{key}[].{sub}", tp.replace("typing.", ""), getattr(sub_defaults, sub), sub_doc))
    return rows


def describe_keys() -> str:
    """Every key with its type, default and description (for ``trickles config --keys``)."""
    lines, section = [], None
    for name, key, tp, default, doc in key_rows():
        if name != section:
            lines.append(f"[{name}]")
            section = name
        lines.append(f"  {name}.{key} = {default!r}  ({tp})\n      {doc}")
    return "\n".join(lines)


def keys_markdown() -> str:
    """The key tables (and model presets) of docs/configuration.md, rendered from :func:`key_rows`."""
    from .models.presets import PRESETS

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("<", "&lt;")

    out, section = [], None
    for name, key, tp, default, doc in key_rows():
        if name != section:
            first_line = (SECTIONS[name].__doc__ or "").strip().splitlines()[0]
            first_line = re.sub(r":\w+:`", "`", first_line.replace("``", "`"))
            out += ["", f"### [{name}]", "", first_line, "", "| key | type | default | meaning |", "|---|---|---|---|"]
            section = name
        value = "none" if default is None else _toml_value(default)
        out.append(f"| `{name}.{key}` | `{cell(tp)}` | `{cell(value)}` | {cell(doc)} |")
    out += [
        "",
        "### Model presets (`model.preset`)",
        "",
        "| preset | flavor | layers | d_model | heads | kv heads | MLP width | vocabulary | tied |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset in PRESETS:
        m = apply_preset(ModelConfig(), preset)
        vocab = m.vocab_size if m.vocab_size is not None else "the tokenizer's"
        out.append(
            f"| `{preset}` | {m.flavor} | {m.n_layers} | {m.d_model} | {m.n_heads} | {m.kv_heads} | "
            f"{m.ffn_dim} | {vocab} | {'yes' if m.tied else 'no'} |"
        )
    return "\n".join(out[1:]) + "\n"
