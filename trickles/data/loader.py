"""Deterministic, data-parallel batches of token windows.

The token array is cut into ``n = (len(tokens) - 1) // seq_len`` non-overlapping windows of
``seq_len + 1`` tokens; window ``i`` starts at ``i * seq_len`` (consecutive windows share one
token), its first ``seq_len`` tokens are the inputs and its last ``seq_len`` the targets.

Sampling is a pure function of ``(seed, g)``, where ``g`` counts samples from the start of the
run: sample ``g`` is window ``perm_e[g % n]`` with epoch ``e = g // n`` and ``perm_e`` a
permutation of ``range(n)`` drawn from ``numpy.random.default_rng([seed, e])``. So every epoch
visits every window exactly once, and the order does not depend on the layout.

A training step's global batch is samples ``consumed .. consumed + B - 1``. Data-parallel rank
``r`` of ``dp`` takes rows ``[r*B/dp, (r+1)*B/dp)`` and cuts them, in order, into micro-batches;
it reads only those rows' windows from the (memory-mapped) array. Concatenating the ranks'
rows gives exactly the one-process batch, and resuming at ``consumed`` gives the same batch as
running on to it. Held-out batch ``k`` is windows ``k*B .. k*B + B - 1`` (mod ``n``), unshuffled,
sliced the same way.

A micro-batch is ``(inputs, targets)``; with labels (hard-routed experts) ``(inputs, targets, labels)``; with
``eos_id`` (``data.document_mask``) ``(inputs, targets, labels or None, documents)``, the inputs' document ids
(:func:`trickles.models.documents.document_ids`: a document starts at each eos).

With ``flags`` (chat data, :mod:`trickles.data.chat`: one ``uint8`` per token) the targets are ``-100`` -- no loss --
wherever the predicted token lacks the ``TRAINED`` flag (:func:`masked_targets`), and the document ids count the
``START`` flags instead of eos tokens (:func:`flag_documents`), always given: ``(inputs, targets, labels or None,
documents)``. These are the training loss's positions: whatever computes a loss from these batches counts the targets
that are not ``-100``.

**The loss of a step with chat data** is the mean over every trained target of the global batch, whatever the layout:
the model's loss is a micro-batch's mean over its own trained targets, so :func:`weigh` appends each micro-batch's
weight ``n * replicas * micro-batches / N`` (``n``: its trained targets on this rank, after context parallelism's cut;
``N``: the global batch's, :meth:`ShardedBatches.trained_targets`), and the mean of the weighted losses over the
micro-batches and the replicas (``dp x cp``) is ``sum of the token losses / N``, as on one process (a micro-batch
with no trained target on this rank, a context-parallel slice of padding, has loss 0 and weight 0). Without flags
every target counts and nothing is appended.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import DataError
from ..models.documents import document_ids

IGNORE = -100  # a target that takes no loss (the model's cross-entropy skips it)
TRAINED, START = 1, 2  # chat data's flag bits: the token is trained (its target counts); it opens a document


def masked_targets(targets: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``targets`` with ``-100`` where the predicted token's ``flags`` (aligned with ``targets``) lack ``TRAINED``."""
    return targets.masked_fill((flags & TRAINED) == 0, IGNORE)


def flag_documents(flags: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int32 document ids of the inputs' ``flags``: the count of ``START`` flags at or before each token."""
    return torch.cumsum((flags & START) != 0, dim=1, dtype=torch.int32)


def weigh(micro: list[tuple], total: int | None, replicas: int) -> list[tuple]:
    """``micro`` with each micro-batch's loss weight appended (module doc); unchanged when ``total`` is None."""
    if total is None:
        return micro
    return [(*b, int((b[1] != IGNORE).sum()) * replicas * len(micro) / max(total, 1)) for b in micro]


def require_boundaries(tokens: np.ndarray, eos_id: int, source: str, chunk: int = 1 << 22) -> None:
    """Refuses ``data.document_mask`` on a token stream without end-of-text ids (a token file written without
    boundaries): every sequence would be one document. Scans in chunks and stops at the first eos."""
    for start in range(0, len(tokens), chunk):
        if np.any(np.asarray(tokens[start : start + chunk]) == eos_id):
            return
    raise DataError(
        f"data.document_mask=true needs end-of-text tokens (id {eos_id}) between documents, and {source} has "
        f"none; write the token file with the eos id after each document, or set data.document_mask=false"
    )


DOCUMENTS = 3  # where a micro-batch holds its document ids (module doc)


class ShardedBatches:
    """One data-parallel rank's view of the batches drawn from ``tokens`` (see module doc)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        labels: np.ndarray | None = None,
        eos_id: int | None = None,
        flags: np.ndarray | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, int(seed)
        self.labels = labels  # each token's label id (hard-routed experts): batches then carry the inputs' labels
        self.eos_id = eos_id  # packed documents (data.document_mask): batches then carry the inputs' document ids
        self.flags = flags  # chat data: each token's flags; batches then carry masked targets and their documents
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.n_windows = max(0, (len(tokens) - 1) // seq_len)
        self._perms: dict[int, np.ndarray] = {}
        self._counts: tuple[np.ndarray, np.ndarray] | None = None  # (window_counts)
        self._drawn: tuple[int, tuple[int, int]] = (-1, (0, 0))  # the last call of drawn: (samples, its totals)

    # ---- which windows -------------------------------------------------------------------
    def permutation(self, epoch: int) -> np.ndarray:
        """The window order of ``epoch`` (the current and the previous one are cached)."""
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            perm = rng.permutation(self.n_windows)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = perm
        return perm

    def windows(self, first: int, count: int) -> np.ndarray:
        """Window indices of global samples ``first .. first + count - 1``."""
        return self.windows_at(np.arange(first, first + count, dtype=np.int64))

    def windows_at(self, g: np.ndarray) -> np.ndarray:
        """Window indices of the samples numbered ``g`` (any order)."""
        count = len(g)
        epochs = g // self.n_windows
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.permutation(int(e))[g[sel] % self.n_windows]
        return out

    # ---- batches ---------------------------------------------------------------------------
    def micro_batches(
        self, consumed: int, global_batch: int, micro_batch: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``(inputs, targets)`` micro-batches of the step starting at sample ``consumed``.

        Each tensor is int64 on the CPU, ``[micro_batch, seq_len]``.
        """
        if consumed < 0:
            raise ValueError(f"consumed must be non-negative, got {consumed}")
        self._require("train")
        start, rows = self._rank_rows(global_batch, micro_batch)
        return self._gather(self.windows(consumed + start, rows), micro_batch)

    def val_micro_batches(
        self, index: int, global_batch: int, micro_batch: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of held-out batch ``index``: windows ``index*B ...`` in order, wrapping."""
        if index < 0:
            raise ValueError(f"index must be non-negative, got {index}")
        self._require("val")
        start, rows = self._rank_rows(global_batch, micro_batch)
        first = index * global_batch + start
        return self._gather(np.arange(first, first + rows, dtype=np.int64) % self.n_windows, micro_batch)

    def trained_targets(self, consumed: int, global_batch: int) -> int | None:
        """The targets that take a loss in the whole global batch starting at sample ``consumed`` (every rank's rows);
        None without flags (every target does)."""
        return None if self.flags is None else self.count_trained(self.windows(consumed, global_batch))

    def val_trained_targets(self, index: int, global_batch: int) -> int | None:
        """As :meth:`trained_targets`, for held-out batch ``index``."""
        first = index * global_batch
        windows = np.arange(first, first + global_batch, dtype=np.int64) % max(self.n_windows, 1)
        return None if self.flags is None else self.count_trained(windows)

    def count_trained(self, windows: np.ndarray) -> int:
        """The trained targets of ``windows`` (``seq_len`` per window without flags)."""
        if self.flags is None:
            return len(windows) * self.seq_len
        index = windows[:, None] * self.seq_len + np.arange(1, self.seq_len + 1, dtype=np.int64)
        return int(np.count_nonzero(np.asarray(self.flags[index]) & TRAINED))

    def window_counts(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(tokens, trained)``, int64 per window: its inputs that are data rather than a packed sequence's padding,
        and its targets that take a loss; None without flags (every input is data, every target trains). A packed
        sequence's padding is its last document when that one has no trained token (a conversation always has one:
        :class:`trickles.data.chat.Packer`)."""
        if self.flags is None:
            return None
        if self._counts is None:
            seq, out = self.seq_len, np.zeros((2, self.n_windows), dtype=np.int64)
            step = max(1, (1 << 22) // seq)
            for w0 in range(0, self.n_windows, step):
                w1 = min(w0 + step, self.n_windows)
                f = np.asarray(self.flags[w0 * seq : w1 * seq + 1])
                inputs, trained = f[:-1].reshape(-1, seq), (f[1:].reshape(-1, seq) & TRAINED) != 0
                last_start = seq - 1 - np.argmax((inputs[:, ::-1] & START) != 0, axis=1)
                has = (inputs & TRAINED) != 0
                last_trained = np.where(has.any(1), seq - 1 - np.argmax(has[:, ::-1], axis=1), -1)
                out[0, w0:w1] = np.where(last_trained >= last_start, seq, last_start)
                out[1, w0:w1] = trained.sum(1)
            self._counts = (out[0], out[1])
        return self._counts

    def drawn(self, samples: int) -> tuple[int, int]:
        """``(tokens, trained)`` of samples ``0 .. samples - 1`` together (:meth:`window_counts`; ``seq_len`` per sample
        each without flags): whole epochs at once and the windows of the last one, or the windows drawn since the
        previous call when that is less than an epoch before."""
        samples = int(samples)
        if self.flags is None:
            return samples * self.seq_len, samples * self.seq_len
        tokens, trained = self.window_counts()
        known, done = self._drawn
        if 0 <= known <= samples <= known + self.n_windows:
            w = self.windows(known, samples - known)
            done = (done[0] + int(tokens[w].sum()), done[1] + int(trained[w].sum()))
        elif samples > 0:
            epochs, rest = divmod(samples, self.n_windows)
            w = self.permutation(epochs)[:rest]
            done = (
                epochs * int(tokens.sum()) + int(tokens[w].sum()),
                epochs * int(trained.sum()) + int(trained[w].sum()),
            )
        else:
            done = (0, 0)
        self._drawn = (samples, done)
        return done

    # ---- helpers ---------------------------------------------------------------------------
    def _require(self, split: str) -> None:
        if self.n_windows < 1:
            raise DataError(
                f"the {split} split has {len(self.tokens)} tokens, fewer than one window of "
                f"data.seq_len + 1 = {self.seq_len + 1}; use a smaller data.seq_len or more data"
            )

    def _rank_rows(self, global_batch: int, micro_batch: int) -> tuple[int, int]:
        if global_batch < 1 or micro_batch < 1:
            raise ValueError(f"global_batch ({global_batch}) and micro_batch ({micro_batch}) must be positive")
        if global_batch % self.dp_size:
            raise ValueError(
                f"global_batch ({global_batch}) is not divisible by the data-parallel size ({self.dp_size})"
            )
        rows = global_batch // self.dp_size
        if rows % micro_batch:
            raise ValueError(
                f"rows per data-parallel rank ({rows} = {global_batch} / {self.dp_size}) are not "
                f"divisible by micro_batch ({micro_batch})"
            )
        return self.dp_rank * rows, rows

    def _gather(self, windows: np.ndarray, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        index = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)
        rows = torch.from_numpy(np.asarray(self.tokens[index], dtype=np.int64))
        inputs, targets = rows[:, :-1], rows[:, 1:]
        flags = None if self.flags is None else torch.from_numpy(np.asarray(self.flags[index], dtype=np.uint8))
        if flags is not None:
            targets = masked_targets(targets, flags[:, 1:])
        # each micro-batch in storage of its own (of one row, .contiguous() would keep a view of the whole batch, which
        # the embedding's backward then holds)
        starts = range(0, len(rows), micro_batch)
        out = [
            (
                inputs[i : i + micro_batch].clone(memory_format=torch.contiguous_format),
                targets[i : i + micro_batch].clone(memory_format=torch.contiguous_format),
            )
            for i in starts
        ]
        if self.labels is not None:
            labels = torch.from_numpy(np.asarray(self.labels[index[:, :-1]], dtype=np.int64))
            out = [(x, y, labels[i : i + micro_batch]) for (x, y), i in zip(out, starts)]
        if flags is not None:
            docs = flag_documents(flags[:, :-1])
            out = [
                (b[0], b[1], b[2] if len(b) > 2 else None, docs[i : i + micro_batch].clone())
                for b, i in zip(out, starts)
            ]
        elif self.eos_id is not None:
            out = [(b[0], b[1], b[2] if len(b) > 2 else None, document_ids(b[0], self.eos_id)) for b in out]
        return out
