"""``trickles eval``: the loss of a checkpoint or a Hugging Face model directory over a whole data source.

**What is counted.** Every predicted token that training would count: the targets of the batches the data loader
builds (:class:`~trickles.data.loader.ShardedBatches`) that are not ``-100`` (a loss mask, such as a chat's
assistant-only mask, already set there). The source -- every source of a mixture, each on its own -- is cut into
its ``n = (len(tokens) - 1) // seq_len`` windows exactly as training cuts it, but nothing is held out
(``data.val_fraction`` is 0) and nothing is shuffled: windows ``0 .. n - 1``, each once. ``max_tokens`` keeps only
the first ``max_tokens`` positions of each source (the windows before, and part of the window it ends in).

**How.** The windows are read in chunks of ``dp x micro_batch``; in chunk ``c`` data-parallel rank ``r`` takes
windows ``c dp b + r b ..`` (``b``: the config's micro-batch). Past the last window a chunk is filled with windows
whose targets are all ``-100``, so every rank runs the same forwards (tensor, pipeline, context parallelism and ZeRO-3
communicate inside them). Each forward returns the micro-batch's mean over its counted targets (on this rank's part
of the sequence with context parallelism); the rank adds ``mean x count`` and ``count`` in float64, and one sum over
the data-parallel (``dp x cp``) group gives the exact totals -- never a mean of means. A pipeline runs one
micro-batch at a time (its evaluation returns the mean over the micro-batches it is given).

**Results.** ``loss`` is the total over the total count and ``perplexity`` its exponential; with a mixture, each
source's own ``loss`` and ``tokens``, the overall ``loss`` over all counted tokens of all sources (each token weighs
the same, whatever the source's weight), and ``weighted_loss``, the sources' losses weighted by their shares as
training's validation loss weights them. With chat data, ``overlong_cut`` and ``overlong_dropped`` count the
conversations longer than ``data.seq_len`` that were cut or left out (``data.overlong``), as training's metrics do.

:func:`eval_config` builds the configuration before any process starts (one-line errors for bad input);
:func:`evaluate` runs in each rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..adapters.lora import apply_lora, is_adapter
from ..config import Config
from ..data import DataConfig, build_tokenizer, load_tokenizer
from ..data.corpus import check_boundaries
from ..data.loader import DOCUMENTS
from ..data.mixture import MixedBatches, Mixture, data_batches, load_data, overlong_counts
from ..data.sources import check_source
from ..data.tokenizers import Tokenizer
from ..errors import DataError, UserError
from ..memory.precision import autocast
from ..models.config import resolve_model
from ..models.transformer import Transformer
from ..parallel.plan import parallelize
from ..parallel.tensor.layers import init_tp_param
from ..process import env_world_size
from ..topology import Topology, distributed_session
from . import checkpoint as ckpt
from . import trainer_state
from .load import hf_model_config, is_hf_dir

IGNORE = -100  # a target that no loss counts
SOURCE_KEYS = ("source", "sources")  # the data keys that say what to read
#: a checkpoint's own data keys that a run evaluated on other data still takes from it, when not given
KEPT_KEYS = ("seq_len", "cache_dir")


@dataclass
class SourceResult:
    """One source's totals (every rank's)."""

    loss: float
    tokens: int
    windows: int

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)


@dataclass
class EvalResult:
    """The evaluation of a model over its data (module doc)."""

    loss: float
    tokens: int
    windows: int
    seq_len: int
    sources: dict[str, SourceResult] | None = None  # a mixture's, by name
    weighted_loss: float | None = None  # a mixture's: the sources' losses weighted by their shares
    overlong: dict[str, int] | None = None  # chat data: conversations cut or dropped (overlong_cut, overlong_dropped)

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)

    def to_dict(self) -> dict[str, Any]:
        """``loss``, ``tokens``, ``perplexity``, ``windows``, ``seq_len``; a mixture's ``sources`` (each one's
        ``loss``, ``tokens``, ``perplexity``, ``windows``) and ``weighted_loss``; chat data's ``overlong_cut`` and
        ``overlong_dropped``."""
        out: dict[str, Any] = {
            "loss": self.loss,
            "tokens": self.tokens,
            "perplexity": self.perplexity,
            "windows": self.windows,
            "seq_len": self.seq_len,
        }
        if self.sources is not None:
            out["sources"] = {
                n: {"loss": s.loss, "tokens": s.tokens, "perplexity": s.perplexity, "windows": s.windows}
                for n, s in self.sources.items()
            }
            out["weighted_loss"] = self.weighted_loss
        out.update(self.overlong or {})
        return out

    def describe(self, model: str) -> str:
        """Lines for a terminal: the overall result, then a mixture's sources."""
        lines = [
            f"{model}: loss {self.loss:.6f}, perplexity {self.perplexity:.4f} over {self.tokens:,} tokens "
            f"({self.windows:,} windows of {self.seq_len})"
        ]
        for name, s in (self.sources or {}).items():
            lines.append(
                f"  {name}: loss {s.loss:.6f}, perplexity {s.perplexity:.4f} over {s.tokens:,} tokens "
                f"({s.windows:,} windows)"
            )
        if self.sources is not None:
            lines.append(
                f"  (loss: the mean over every counted token; by the sources' shares: {self.weighted_loss:.6f})"
            )
        if self.overlong:
            lines.append(
                f"  ({self.overlong['overlong_cut']} conversations longer than data.seq_len {self.seq_len} cut, "
                f"{self.overlong['overlong_dropped']} left out: data.overlong)"
            )
        return "\n".join(lines)


def perplexity(loss: float) -> float:
    """``exp(loss)`` (infinite past what a float holds)."""
    return math.exp(loss) if loss < 700 else math.inf


# ---- the configuration, before any process starts -------------------------------------------------------------------


def _given_data_keys(config_file: str | None, overrides: list[str]) -> set[str]:
    """The ``[data]`` keys the user set, in the TOML file (already read once by Config.load) or with ``--set``."""
    keys: set[str] = set()
    if config_file is not None:
        with open(config_file, "rb") as f:
            keys |= set((tomllib.load(f).get("data") or {}).keys())
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.startswith("data."):
            keys.add(key[len("data.") :])
    return keys


def eval_config(
    model: str, config_file: str | None = None, overrides: list[str] = (), data: str | None = None, world: int = 1
) -> Config:
    """The configuration that evaluates ``model`` (a checkpoint, a run's out_dir or a Hugging Face directory), checked
    for ``world`` processes; every mistake a one-line :class:`~trickles.errors.UserError`.

    The model's shape and weights are ``model``'s (``train.init_from``: the checkpoint directory, resolved), a LoRA
    run's adapters with them. The data is what ``config_file``, ``overrides`` and ``data`` (``data.source``) give. A
    trickles checkpoint given no source evaluates on its run's own data section (the keys given still override it);
    given one, it keeps only its run's ``data.seq_len`` and ``data.cache_dir`` where they are not given. A Hugging
    Face directory has no data of its own: one must be given (``data.seq_len`` then defaults to 256, or the model's
    context if shorter). A checkpoint is read with its run's tokenizer (``data.tokenizer`` is set:
    :func:`_run_tokenizer`), a Hugging Face directory with its own when it has one (else ``data.tokenizer``).
    Nothing is held out (``data.val_fraction = 0``); no QAT, distillation or compilation."""
    overrides = list(overrides) + ([f"data.source={data}"] if data is not None else [])
    if not os.path.exists(model):
        raise UserError(
            f"{model} does not exist; give a checkpoint directory, a run's out_dir or a Hugging Face model directory"
        )
    hf = is_hf_dir(model)
    if hf:
        hf_model_config(model, "the model")  # one line for a directory of an unknown model_type
    else:
        try:
            model = ckpt.resolve(model)
        except UserError as e:
            raise UserError(f"{e} (nor a Hugging Face model directory: it has no config.json)") from None
        ckpt.verify(model)
    cfg = Config.load(config_file, [*overrides, f"train.init_from={model}"])
    given = _given_data_keys(config_file, overrides)
    has_source = bool(given & set(SOURCE_KEYS))
    if hf and not has_source:
        raise UserError(
            f"{model} is a Hugging Face directory and carries no data; give the data to evaluate on: --data PATH, "
            "--set data.source=PATH, or [[data.sources]] in --config"
        )
    if not hf:
        meta = ckpt.read_json(os.path.join(model, "trainer.json"))
        run_data = (meta.get("config") or {}).get("data") or {}
        fields = {f.name for f in dataclasses.fields(cfg.data)}
        keep = set(KEPT_KEYS) if has_source else fields - {"tokenizer"}
        cfg.data = dataclasses.replace(cfg.data, **{k: v for k, v in run_data.items() if k in keep and k not in given})
        run_train = (meta.get("config") or {}).get("train") or {}
        lora = {k: v for k, v in run_train.items() if k.startswith("lora_") and hasattr(cfg.train, k)}
        cfg.train = dataclasses.replace(cfg.train, **{"lora_rank": 0, **lora})
        cfg.data.tokenizer = _run_tokenizer(model, run_data.get("tokenizer"))
    else:
        cfg.train.lora_rank = 0
        if "seq_len" not in given:
            cfg.data.seq_len = min(cfg.data.seq_len, hf_model_config(model, "the model").max_seq_len)
    cfg.data.val_fraction = 0.0
    cfg.train.qat = cfg.train.compile = False
    cfg.distill = type(cfg.distill)()
    cfg.validate(world)  # the model's shape from train.init_from, the layout, the batch plan
    check_source(cfg.data)
    check_boundaries(cfg.data)
    tokenizer = model_tokenizer(cfg)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} ids and the model {model} only {cfg.model.vocab_size}; "
            "give the model's own tokenizer (data.tokenizer, for a Hugging Face directory without one)"
        )
    return cfg


def _run_tokenizer(checkpoint: str, recorded: str | None) -> str:
    """``data.tokenizer`` for reading a checkpoint's data: ``byte``; the run's own tokenizer directory when it still
    holds the tokenizer the checkpoint saved (what training read); else the copy in the checkpoint, which keeps the
    directory's special tokens and chat template (:mod:`trickles.data.tokenizer_files`) and so renders the same."""
    saved_dir = os.path.join(checkpoint, "tokenizer")
    saved = load_tokenizer(saved_dir)
    if saved.identity() == "byte":
        return "byte"
    if recorded not in (None, "byte", "bpe") and os.path.isdir(os.path.expanduser(recorded)):
        try:
            if build_tokenizer(DataConfig(tokenizer=recorded)).identity() == saved.identity():
                return recorded
        except UserError:
            pass  # (no longer a tokenizer: the checkpoint's copy)
    return saved_dir


def model_tokenizer(cfg: Config) -> Tokenizer:
    """The tokenizer that reads the data of the model ``train.init_from``: ``data.tokenizer`` (a Hugging Face
    directory's own when it holds one, :meth:`Config.from_dict`; a checkpoint's run's, :func:`_run_tokenizer`), a
    checkpoint's saved copy rebuilt exactly as it was saved."""
    saved_dir = os.path.join(cfg.train.init_from, "tokenizer")
    if cfg.data.tokenizer == saved_dir:
        return load_tokenizer(saved_dir)
    return build_tokenizer(cfg.data)


# ---- in each rank ---------------------------------------------------------------------------------------------------


def build_model(cfg: Config, topo: Topology, model: str, vocab: int):
    """The engine holding ``model``'s weights (and a LoRA run's adapters) on ``topo``'s layout, in eval mode."""
    model_cfg = resolve_model(cfg.model, vocab, cfg.data.seq_len)
    with torch.device("meta"):
        net = Transformer(model_cfg)
    lora = cfg.train.lora()
    if lora is not None:
        apply_lora(net, lora)
    init = trainer_state.init_source(model, net)
    engine = parallelize(net, topo, cfg, cfg.train.seed, init=init)
    if lora is not None:  # the plan starts adapters at their initial values: put the trained ones in
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                if is_adapter(name):
                    p.copy_(init_tp_param(init(name, p), p))
    engine.model.eval()
    return engine


@torch.no_grad()
def evaluate(cfg: Config, topo: Topology, max_tokens: int | None = None) -> EvalResult:
    """Every rank's part of the evaluation of the model ``train.init_from`` on ``cfg.data`` (both from
    :func:`eval_config`); every rank returns the same result."""
    world = topo.comm("world")
    if not topo.is_main:  # rank 0 tokenizes into the cache first, the others then read it
        world.barrier(limit_s=math.inf)
    tokenizer = model_tokenizer(cfg)
    hard = cfg.model.moe_experts and cfg.model.moe_router == "hard"
    data = load_data(cfg.data, tokenizer, list(cfg.model.label_experts) if hard else None)
    if topo.is_main:
        world.barrier(limit_s=math.inf)
    seq = cfg.data.seq_len
    dp = topo.comm("dp")
    eos = tokenizer.eos_id if cfg.data.document_mask else None
    streams = data_batches(data, seq, cfg.train.seed, dp.rank, dp.size, eos)[0]
    parts = streams.parts if isinstance(streams, MixedBatches) else [streams]
    names = data.names if isinstance(data, Mixture) else [cfg.data.source]
    for name, part in zip(names, parts):
        if part.n_windows < 1:
            raise DataError(
                f"{name} has {len(part.tokens)} tokens, fewer than one window of data.seq_len + 1 = {seq + 1}; "
                "use a smaller data.seq_len or more data"
            )
    engine = build_model(cfg, topo, cfg.train.init_from, tokenizer.vocab_size)
    micro = cfg.batch_plan(topo.dims.dp)[0]
    sums = torch.zeros(len(parts), 3, dtype=torch.float64, device=topo.device)  # loss x tokens, tokens, windows
    for i, part in enumerate(parts):
        positions = part.n_windows * seq if max_tokens is None else min(part.n_windows * seq, max_tokens)
        sums[i] = _source_sums(engine, cfg, topo, part, positions, micro)
    topo.replicas().all_reduce(sums)
    totals = [(float(s[0]), int(s[1]), int(s[2])) for s in sums.tolist()]
    for name, (_, tokens, _) in zip(names, totals):
        if tokens == 0:
            raise DataError(f"no target of {name} counts toward the loss (every one is masked); check the data")
    loss = sum(t[0] for t in totals) / sum(t[1] for t in totals)
    result = EvalResult(loss, sum(t[1] for t in totals), sum(t[2] for t in totals), seq)
    if isinstance(data, Mixture):
        result.sources = {n: SourceResult(s / c, c, w) for n, (s, c, w) in zip(names, totals)}
        result.weighted_loss = data.weighted({n: r.loss for n, r in result.sources.items()})
    result.overlong = overlong_counts(data) or None
    del engine
    return result


def _source_sums(engine, cfg: Config, topo: Topology, part, positions: int, micro: int) -> torch.Tensor:
    """``[loss x tokens, tokens, windows]`` of this rank's windows of ``part`` among the first ``positions``
    (module doc)."""
    seq, dp = part.seq_len, part.dp_size
    windows = -(-positions // seq)
    chunk = dp * micro
    out = torch.zeros(3, dtype=torch.float64, device=topo.device)
    for c in range(-(-windows // chunk)):
        (batch,) = part.val_micro_batches(c, chunk, micro)  # windows c*chunk + rank*micro .. (wrapping: masked below)
        first = c * chunk + part.dp_rank * micro
        index = first + torch.arange(micro)
        y = batch[1]
        y[index >= windows] = IGNORE  # past the last window: fillers
        y[index == windows - 1, positions - (windows - 1) * seq :] = IGNORE  # the cap's cut in its last window
        batch = tuple(t if t is None or i == DOCUMENTS else engine.shard_sequence(t) for i, t in enumerate(batch))
        count = (batch[1] != IGNORE).sum().to(torch.float64)
        mean = _forward(engine, cfg, topo, batch).to(torch.float64)
        out[0] += torch.where(count > 0, mean * count, 0.0).to(out.device)
        out[1] += count.to(out.device)
        out[2] += int((index < windows).sum()) if topo.comm("cp").rank == 0 else 0  # (the cp ranks share them)
    return out


def _forward(engine, cfg: Config, topo: Topology, batch: tuple) -> torch.Tensor:
    """The micro-batch's mean loss over its counted targets (every pipeline stage returns it)."""
    if engine.pipeline is not None:
        return engine.pipeline.forward_only([batch])
    x, y = batch[0].to(topo.device), batch[1].to(topo.device)
    labels = batch[2] if len(batch) > 2 else None
    extra = {"documents": batch[3]} if len(batch) > 3 and batch[3] is not None else {}
    with autocast(cfg.memory.precision, topo.device):
        return engine.model(x, labels=labels, target=y, **extra).float()


def run_eval(cfg: Config, max_tokens: int | None = None, as_json: bool = False, quiet: bool = False) -> EvalResult:
    """Evaluates in this process (one rank of a launcher or torchrun job, or alone); rank 0 prints the result: one
    JSON line (``as_json``), else lines for a terminal (none when ``quiet``)."""
    dims = cfg.validate(env_world_size())
    with distributed_session(dims, cfg.train.device, cfg.parallel.timeout_s) as topo:
        result = evaluate(cfg, topo, max_tokens)
        if topo.is_main and not quiet:
            text = json.dumps(result.to_dict()) if as_json else result.describe(cfg.train.init_from)
            print(text, flush=True)
    return result
