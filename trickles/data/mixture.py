"""A weighted mixture of sources (``[[data.sources]]``): which source each sample comes from, and its batches.

**Which source.** Samples are numbered ``g = 0, 1, ...`` from the start of the run, as for one source
(:mod:`trickles.data.loader`). They are drawn in strata of ``BLOCK`` consecutive samples. Block ``b`` holds
``floor(BLOCK * p_s)`` samples of source ``s`` (``p``: the weights normalised to sum to 1) plus the ``r = BLOCK - sum_s
floor(BLOCK * p_s)`` left over, given out by systematic sampling over the fractional parts ``f_s = BLOCK * p_s -
floor(BLOCK * p_s)`` at the points ``u_b + i`` (``i < r``): source ``s`` gets one more with probability exactly ``f_s``,
so every sample is of source ``s`` with probability ``p_s``. ``u_b = (u + b * 0.618...) mod 1`` with ``u`` drawn from
``numpy.random.default_rng([seed, 0])``: a low-discrepancy sequence, so over any run of blocks the left-overs too follow
the fractional parts within a sample or two, where independent draws would wander. The block's samples are then put in
an order drawn by ``default_rng([seed, 1, b])``. So the sources of a block's samples, and each sample's number among its
source's samples (the count of that source in the blocks before -- summed ``CHUNK`` blocks at a time, kept -- plus its
rank in its block), are a pure function of the seed and ``g``: there is no state but the consumed-sample count that
checkpoints already hold, and a resume at any step, at any data-parallel degree, continues the mixture where it was.
Every source stays within a few samples of its share at every point of a run (independent draws would stray by about the
square root of the samples).

**Which tokens.** Each source is tokenized into a corpus of its own (:func:`trickles.data.corpus.load_corpus`, cached
per source) and cut into windows as one source is; the ``k``-th sample of source ``s`` is that source's sample ``k``
under its own seed (a function of ``seed`` and ``s``), so each source goes through its windows epoch by epoch, in an
order of its own, whatever the others do. :class:`MixedBatches` gathers a step's rows from the sources and cuts them
into micro-batches exactly as :class:`~trickles.data.loader.ShardedBatches` does (data-parallel rank ``r`` takes rows
``[r B/dp, (r+1) B/dp)`` of the global batch). Held out are each source's own validation split, evaluated source by
source; the mixture's validation loss is their mean weighted by ``p``.

**What the metrics count** (:meth:`MixedBatches.source_counts`): of the first ``g`` samples, each source's tokens that
are data (``seq_len`` per sample of a text source; a packed chat sequence's without its padding) and its targets that
took a loss -- sums over its samples' windows (whole epochs at once), so, like the draw, a function of ``g`` alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import DataError
from .config import DataConfig
from .corpus import Corpus, load_corpus
from .loader import ShardedBatches, require_boundaries
from .tokenizers import Tokenizer

BLOCK = 64  # samples per stratum
CHUNK = 4096  # blocks whose left-over samples are counted at once
GOLDEN = (5**0.5 - 1) / 2  # the step of the left-over draws' low-discrepancy sequence


class MixtureSampler:
    """Which source global sample ``g`` is drawn from, and its number among that source's samples (module doc)."""

    def __init__(self, weights: Sequence[float], seed: int, block: int = BLOCK):
        p = np.asarray(weights, dtype=np.float64)
        if p.ndim != 1 or len(p) < 1 or not np.all(np.isfinite(p)) or np.any(p <= 0):
            raise ValueError(f"weights must be positive numbers, got {list(weights)}")
        self.p, self.seed, self.block = p / p.sum(), int(seed) % 2**64, int(block)
        quota = self.block * self.p
        self.base = np.floor(quota).astype(np.int64)
        self.extra = self.block - int(self.base.sum())  # the left-over samples of each block
        cum = np.cumsum(quota - self.base)
        self.edges = np.concatenate([[0.0], cum * (self.extra / cum[-1]) if self.extra else cum * 0])
        self.edges[-1] = self.extra  # (exactly: every left-over sample lands in some source)
        self.u0 = float(np.random.default_rng([self.seed, 0]).random())
        self._chunk_totals = [np.zeros(len(p), dtype=np.int64)]  # extras of the blocks before chunk c
        self._extras: tuple[int, np.ndarray] | None = None
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def n_sources(self) -> int:
        return len(self.p)

    def _chunk_extras(self, chunk: int) -> np.ndarray:
        """``[CHUNK, sources]``: the left-over samples each block of ``chunk`` gives each source (0 or 1)."""
        if self._extras is None or self._extras[0] != chunk:
            u = ((self.u0 + (chunk * CHUNK + np.arange(CHUNK)) * GOLDEN) % 1.0)[:, None]
            below = np.clip(np.ceil(self.edges[None, :] - u), 0, self.extra).astype(np.int64)
            self._extras = (chunk, np.diff(below, axis=1))
        return self._extras[1]

    def counts_before(self, b: int) -> np.ndarray:
        """Samples of each source in blocks ``0 .. b - 1``."""
        chunk, within = divmod(b, CHUNK)
        while len(self._chunk_totals) <= chunk:
            c = len(self._chunk_totals) - 1
            self._chunk_totals.append(self._chunk_totals[-1] + self._chunk_extras(c).sum(0))
        extras = self._chunk_totals[chunk] + self._chunk_extras(chunk)[:within].sum(0)
        return b * self.base + extras

    def block_sources(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source of each sample of block b, its rank among the block's samples of that source)``."""
        got = self._blocks.get(b)
        if got is None:
            counts = self.base + self._chunk_extras(b // CHUNK)[b % CHUNK]
            sources = np.repeat(np.arange(self.n_sources), counts)
            np.random.default_rng([self.seed, 1, b]).shuffle(sources)
            order = np.argsort(sources, kind="stable")
            ranks = np.empty(self.block, dtype=np.int64)
            ranks[order] = np.arange(self.block) - np.repeat(np.cumsum(counts) - counts, counts)
            got = (sources, ranks)
            self._blocks = {k: v for k, v in self._blocks.items() if b - 2 < k <= b}  # the blocks a step spans
            self._blocks[b] = got
        return got

    def draw(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sources, numbers)`` of samples ``first .. first + count - 1``: each one's source and its number among
        that source's samples."""
        if first < 0 or count < 0:
            raise ValueError(f"first ({first}) and count ({count}) must be non-negative")
        sources, numbers = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
        g = first
        while g < first + count:
            b, j = divmod(g, self.block)
            n = min(self.block - j, first + count - g)
            src, rank = self.block_sources(b)
            sources[g - first : g - first + n] = src[j : j + n]
            numbers[g - first : g - first + n] = rank[j : j + n] + self.counts_before(b)[src[j : j + n]]
            g += n
        return sources, numbers

    def counts(self, n: int) -> np.ndarray:
        """Samples of each source among the first ``n``."""
        b, j = divmod(n, self.block)
        return self.counts_before(b) + np.bincount(self.block_sources(b)[0][:j], minlength=self.n_sources)


class MixedBatches:
    """One data-parallel rank's batches of a mixture: the interface of :class:`~trickles.data.loader.ShardedBatches`
    (module doc); ``parts``: each source's batches at this rank (their own seeds)."""

    def __init__(self, names: list[str], sampler: MixtureSampler, parts: list[ShardedBatches]):
        self.names, self.sampler, self.parts = names, sampler, parts
        self.seq_len = parts[0].seq_len

    def micro_batches(self, consumed: int, global_batch: int, micro_batch: int) -> list[tuple]:
        """This rank's micro-batches of the step starting at sample ``consumed`` (as ShardedBatches')."""
        if consumed < 0:
            raise ValueError(f"consumed must be non-negative, got {consumed}")
        start, rows = self.parts[0]._rank_rows(global_batch, micro_batch)
        sources, numbers = self.sampler.draw(consumed + start, rows)
        picked, pieces = [], []
        for s in np.unique(sources):
            part, sel = self.parts[s], np.flatnonzero(sources == s)
            part._require(f"train ({self.names[s]})")
            picked.append(sel)
            pieces.append(part._gather(part.windows_at(numbers[sel]), len(sel))[0])
        back = torch.from_numpy(np.argsort(np.concatenate(picked), kind="stable"))
        fields = [
            None if pieces[0][i] is None else torch.cat([p[i] for p in pieces])[back] for i in range(len(pieces[0]))
        ]
        return [
            tuple(None if f is None else f[i : i + micro_batch].clone() for f in fields)
            for i in range(0, rows, micro_batch)
        ]

    def trained_targets(self, consumed: int, global_batch: int) -> int | None:
        """The targets that take a loss in the global batch starting at ``consumed`` (as ShardedBatches'); None when no
        source has flags (chat data)."""
        if all(part.flags is None for part in self.parts):
            return None
        sources, numbers = self.sampler.draw(consumed, global_batch)
        return sum(part.count_trained(part.windows_at(numbers[sources == s])) for s, part in enumerate(self.parts))

    def source_samples(self, consumed: int) -> dict[str, int]:
        """Samples drawn from each source in the first ``consumed`` (the whole run's, every rank's)."""
        return dict(zip(self.names, (int(c) for c in self.sampler.counts(consumed))))

    def source_tokens(self, consumed: int) -> dict[str, int]:
        """Tokens drawn from each source in the first ``consumed`` samples: the inputs of its samples that are data --
        ``seq_len`` per sample of a text source, a chat sequence's conversations without the padding after them."""
        return dict(zip(self.names, (part.drawn(n)[0] for part, n in zip(self.parts, self.sampler.counts(consumed)))))

    def source_trained_tokens(self, consumed: int) -> dict[str, int]:
        """Targets that took a loss from each source in the first ``consumed`` samples (a chat source's assistant
        tokens; ``seq_len`` per sample of a text source)."""
        return dict(zip(self.names, (part.drawn(n)[1] for part, n in zip(self.parts, self.sampler.counts(consumed)))))

    def source_counts(self, consumed: int) -> dict[str, dict[str, int]]:
        """What a metrics record holds of the first ``consumed`` samples: ``source_tokens``, and with a chat source
        ``source_trained_tokens`` (docs/data.md)."""
        out = {"source_tokens": self.source_tokens(consumed)}
        if any(part.flags is not None for part in self.parts):
            out["source_trained_tokens"] = self.source_trained_tokens(consumed)
        return out


def overlong_counts(data: Corpus | Mixture) -> dict[str, int]:
    """Chat data: ``{"overlong_cut": n, "overlong_dropped": m}``, the conversations longer than ``data.seq_len`` cut
    to it or left out while packing (every chat source's, training and held-out split together: the corpus's, the
    same at every layout and on every resume); empty without chat data."""
    counts = [c.chat for c in (data.corpora if isinstance(data, Mixture) else [data]) if c.chat is not None]
    if not counts:
        return {}
    return {"overlong_cut": sum(c["truncated"] for c in counts), "overlong_dropped": sum(c["dropped"] for c in counts)}


def source_names(cfg: DataConfig) -> list[str]:
    """Each source's name: its ``name``, else its path's last part without the extension (a glob's: the last part
    before the first with a wildcard), made unique with ``-<position>``."""
    out: list[str] = []
    for i, s in enumerate(cfg.sources, 1):
        parts = [p for p in os.path.expanduser(s.path).replace("\\", "/").split("/") if p]
        fixed = parts[: next((k for k, p in enumerate(parts) if any(c in p for c in "*?[")), None)]
        name = s.name or (os.path.splitext(fixed[-1])[0] if fixed else "") or f"source{i}"
        given = {x.name for x in cfg.sources if x.name}
        while name in out or (not s.name and name in given):
            name = f"{name}-{i}"
        out.append(name)
    return out


def derived_seed(seed: int, source: int) -> int:
    """Source ``source``'s own seed, a function of the run's seed (its windows' order)."""
    return int(np.random.SeedSequence([int(seed) % 2**64, 2, source]).generate_state(1, np.uint64)[0])


@dataclass
class Mixture:
    """A mixture's sources (names, weights normalised to sum to 1) and each one's tokenized corpus."""

    names: list[str]
    weights: list[float]
    corpora: list[Corpus]

    @classmethod
    def load(cls, cfg: DataConfig, tokenizer: Tokenizer, cache_dir: str | None = None) -> Mixture:
        """Tokenizes (or reads from the cache) every source of ``cfg.sources``."""
        cfg.check_sources()
        total = sum(s.weight for s in cfg.sources)
        corpora = [load_corpus(one, tokenizer, cache_dir) for one in cfg.per_source()]
        return cls(source_names(cfg), [s.weight / total for s in cfg.sources], corpora)

    def describe(self) -> str:
        """One line: each source's name, share and corpus."""
        return "mixture of " + "; ".join(
            f"{n} ({w:.0%}): {c.describe()}" for n, w, c in zip(self.names, self.weights, self.corpora)
        )

    def batches(
        self, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1, eos_id: int | None = None
    ) -> MixedBatches:
        """The training batches of this data-parallel rank (``eos_id``: with document ids, as ShardedBatches)."""
        parts = []
        for i, (name, corpus) in enumerate(zip(self.names, self.corpora)):
            if eos_id is not None and corpus.train_flags is None:
                require_boundaries(corpus.train, eos_id, f"source {name}")
            seed_i = derived_seed(seed, i)
            parts.append(
                ShardedBatches(corpus.train, seq_len, seed_i, dp_rank, dp_size, None, eos_id, corpus.train_flags)
            )
        return MixedBatches(self.names, MixtureSampler(self.weights, seed), parts)

    def held_out(
        self, seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1, eos_id: int | None = None
    ) -> dict[str, ShardedBatches]:
        """Each source's held-out batches (the sources with at least one window of held-out tokens)."""
        return {
            name: ShardedBatches(corpus.val, seq_len, seed, dp_rank, dp_size, None, eos_id, corpus.val_flags)
            for name, corpus in zip(self.names, self.corpora)
            if len(corpus.val) > seq_len
        }

    def weighted(self, losses: dict[str, float]) -> float | None:
        """The mean of per-source ``losses`` weighted by the sources' shares (renormalised over those given)."""
        w = {n: p for n, p in zip(self.names, self.weights) if n in losses}
        return sum(losses[n] * p for n, p in w.items()) / sum(w.values()) if w else None


def load_data(cfg: DataConfig, tokenizer: Tokenizer, labels: list[str] | None = None) -> Corpus | Mixture:
    """The run's tokenized data: one source's :class:`~trickles.data.corpus.Corpus` (``labels``: hard-routed
    experts', see :func:`~trickles.data.corpus.load_corpus`), or a :class:`Mixture` of ``[[data.sources]]``."""
    if not cfg.sources:
        return load_corpus(cfg, tokenizer, cfg.cache_dir, labels=labels)
    if labels is not None:
        raise DataError("hard-routed experts need one data.source with labels; [[data.sources]] has none yet")
    return Mixture.load(cfg, tokenizer, cfg.cache_dir)


def data_batches(
    data: Corpus | Mixture, seq_len: int, seed: int, dp_rank: int, dp_size: int, eos_id: int | None = None
) -> tuple[ShardedBatches | MixedBatches, ShardedBatches | dict[str, ShardedBatches] | None]:
    """``(training batches, held-out batches)`` of this data-parallel rank: a corpus's (no held-out batches when its
    held-out split is shorter than a window), or a mixture's (held-out batches by source). ``eos_id``: the batches
    carry document ids (``data.document_mask``), which needs end-of-text tokens in the data."""
    if isinstance(data, Mixture):
        return data.batches(seq_len, seed, dp_rank, dp_size, eos_id), data.held_out(
            seq_len, seed, dp_rank, dp_size, eos_id
        )
    if eos_id is not None and data.train_flags is None:  # (chat data's documents are its flags')
        require_boundaries(data.train, eos_id, data.source)
    train = ShardedBatches(data.train, seq_len, seed, dp_rank, dp_size, data.train_labels, eos_id, data.train_flags)
    val = ShardedBatches(data.val, seq_len, seed, dp_rank, dp_size, data.val_labels, eos_id, data.val_flags)
    return train, val if len(data.val) > seq_len else None
