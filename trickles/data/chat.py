"""Chat data (``data.format = "chat"``): conversations rendered by the tokenizer's chat template, packed whole into
sequences, the loss on the assistant's tokens only.

**Records.** A ``.jsonl`` file (one JSON object per line), a ``.parquet`` file or a directory written by ``datasets``'
``save_to_disk`` (a glob of such files works too). A record holds either

* ``data.messages_field`` (default ``messages``): a list of ``{"role", "content"}`` (OpenAI's shape; roles ``system``,
  ``developer``, ``user``, ``assistant``, ``tool``; content a string; other keys are passed to the template), or
* ``data.prompt_field`` and ``data.completion_field`` (default ``prompt`` / ``completion``): two strings, or two lists
  of messages -- trained on the completion only, as TRL's ``SFTTrainer`` does
  (:mod:`trickles.data.chat_template`).

Which tokens of a conversation train is :mod:`trickles.data.chat_template`'s (the template's ``{% generation %}``
blocks, else the assistant messages found by rendering).

**Packing.** Conversations are tokenized in file order and packed whole into sequences of ``data.seq_len`` tokens:
each goes to the first of the last ``OPEN`` sequences with room for it (else a new one; the oldest open one is closed
when more are open), the rest of a sequence is padding (eos ids, not trained). A conversation longer than
``data.seq_len`` is cut to its first ``data.seq_len`` tokens (``data.overlong = "truncate"``) or left out (``"drop"``);
one with no trained token (no assistant message, or all of it cut away) is left out. Both are counted, and the counts
are in the run's data line.

**What the loader gets** (:mod:`trickles.data.corpus` writes it, :mod:`trickles.data.loader` reads it): the sequences
one after another as one token stream (training sequences, one padding token, held-out sequences, one padding token:
so the loader's windows of ``seq_len + 1`` tokens are exactly the sequences) and beside it one ``uint8`` of flags per
token: ``TRAINED`` (the token is an assistant token: the target predicting it counts) and ``START`` (the token opens
a conversation, or a run of padding). Batches then carry targets of ``-100`` where no loss is taken and document ids
counting the ``START`` flags, so every conversation attends only to itself with positions from 0
(:mod:`trickles.models.documents`). The held-out split is the last ``ceil(val_fraction * sequences)`` sequences (at
least one when ``val_fraction > 0`` and there are two).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import DataError
from .chat_template import ChatTemplate, special_tokens
from .config import DataConfig
from .formats import columns_of, is_saved_dataset, rows
from .loader import START, TRAINED
from .sources import resolve_files
from .tokenizers import HFTokenizer, Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
OPEN = 64  # sequences still open to conversations while packing


def container(path: str) -> str:
    """How a chat file is read: ``jsonl``, ``parquet`` or ``datasets`` (by its extension, or a saved dataset)."""
    if os.path.isdir(path) and is_saved_dataset(path):
        return "datasets"
    ext = os.path.splitext(path)[1].lower()
    if ext in (".jsonl", ".parquet"):
        return ext[1:]
    raise DataError(
        f"{path}: chat data (data.format=chat) is read from .jsonl or .parquet files or a datasets directory; "
        "convert the file or point data.source at one of those"
    )


def chat_template(cfg: DataConfig, tokenizer: Tokenizer) -> ChatTemplate:
    """The tokenizer's chat template; DataError when the tokenizer is not a Hugging Face one or has none."""
    if not isinstance(tokenizer, HFTokenizer) or cfg.tokenizer in ("byte", "bpe"):
        raise DataError(
            f"data.format=chat renders conversations with a Hugging Face tokenizer's chat template, and "
            f"data.tokenizer is {cfg.tokenizer!r}; set data.tokenizer to a tokenizer (or model) directory"
        )
    if not tokenizer.chat_template:
        raise DataError(
            f"data.tokenizer {cfg.tokenizer!r} has no chat template (chat_template in tokenizer_config.json or "
            "chat_template.jinja); add one or use a tokenizer that has one"
        )
    path = os.path.expanduser(cfg.tokenizer)
    directory = os.path.dirname(path) if os.path.isfile(path) else path
    return ChatTemplate(tokenizer, tokenizer.chat_template, special_tokens(directory, tokenizer))


def records(cfg: DataConfig, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` of every record of a chat file, ``where`` naming the file and line or row."""
    kind = container(path)
    if kind == "jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e}); fix or remove that line") from None
                yield f"{path}:{lineno}", record if isinstance(record, dict) else {}
        return
    have = columns_of(cfg, path, kind)
    wanted = [c for c in (cfg.messages_field, cfg.prompt_field, cfg.completion_field) if c in have]
    if cfg.messages_field not in have and not {cfg.prompt_field, cfg.completion_field} <= set(have):
        raise DataError(
            f"{path} has no column {cfg.messages_field!r} (nor {cfg.prompt_field!r} and {cfg.completion_field!r}; "
            f"its columns: {', '.join(have) or 'none'}); set data.messages_field to the column holding the messages"
        )
    for n, row in rows(cfg, path, kind, wanted):
        yield f"{path}: row {n}", {k: v for k, v in row.items() if v is not None}


def _messages(where: str, messages: Any, field: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {field!r} is not a non-empty list of messages; fix the record")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: message {i} of {field!r} has no 'role'; give every message a role and content")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has the unknown role {m['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise DataError(f"{where}: message {i} ({m['role']}) has no text content; give its content as a string")
    return messages


def check_record(cfg: DataConfig, where: str, record: dict) -> tuple[str, Any, Any]:
    """``("messages", messages, None)`` or ``("prompt", prompt, completion)``; DataError (one line) for a record of
    neither shape, a message without a role or content, or an unknown role."""
    if cfg.messages_field in record:
        return "messages", _messages(where, record[cfg.messages_field], cfg.messages_field), None
    prompt, completion = record.get(cfg.prompt_field), record.get(cfg.completion_field)
    if isinstance(prompt, str) and isinstance(completion, str):
        return "prompt", prompt, completion
    if isinstance(prompt, list) and isinstance(completion, list):
        return "prompt", _messages(where, prompt, cfg.prompt_field), _messages(where, completion, cfg.completion_field)
    raise DataError(
        f"{where}: no {cfg.messages_field!r} list (nor {cfg.prompt_field!r} and {cfg.completion_field!r}); give each "
        "record its messages or set data.messages_field"
    )


def examples(cfg: DataConfig, tokenizer: Tokenizer, files: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(ids, trained)`` of every record of ``files``, in order (:class:`ChatTemplate`)."""
    template = chat_template(cfg, tokenizer)
    for path in files:
        for where, record in records(cfg, path):
            kind, a, b = check_record(cfg, where, record)
            try:
                yield template.conversation(a) if kind == "messages" else template.prompt_completion(a, b)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None


def check_chat(cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """Before any process starts: the tokenizer has a chat template, every record has a shape :func:`check_record`
    takes (read, not rendered) and each file's first record renders (a template that refuses it, or renders
    conversations in a way the trained positions cannot be found from, fails here rather than in the ranks)."""
    template = chat_template(cfg, tokenizer)
    for path in resolve_files(cfg):
        for n, (where, record) in enumerate(records(cfg, path)):
            kind, a, b = check_record(cfg, where, record)
            try:
                if n == 0:
                    template.conversation(a) if kind == "messages" else template.prompt_completion(a, b)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None


class Packer:
    """Packs conversations whole into sequences of ``seq_len`` tokens (module doc); :meth:`add` returns the
    sequences it closes, :meth:`finish` the rest, each as ``(ids, flags)``."""

    def __init__(self, seq_len: int, pad_id: int, overlong: str):
        self.seq_len, self.pad_id, self.overlong = seq_len, pad_id, overlong
        self.open: list[tuple[list[np.ndarray], list[np.ndarray], int]] = []
        self.counts = {"conversations": 0, "truncated": 0, "dropped": 0, "untrained": 0, "sequences": 0}

    def add(self, ids: np.ndarray, trained: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        if len(ids) > self.seq_len:
            if self.overlong == "drop":
                self.counts["dropped"] += 1
                return []
            self.counts["truncated"] += 1
            ids, trained = ids[: self.seq_len], trained[: self.seq_len]
        flags = np.where(trained, TRAINED, 0).astype(np.uint8)
        if len(flags) == 0 or not flags[1:].any():  # (the first token is never a target of its own conversation)
            self.counts["untrained"] += 1
            return []
        flags[0] = START
        self.counts["conversations"] += 1
        for i, (pieces, marks, used) in enumerate(self.open):
            if used + len(ids) <= self.seq_len:
                pieces.append(ids)
                marks.append(flags)
                self.open[i] = (pieces, marks, used + len(ids))
                return []
        self.open.append(([ids], [flags], len(ids)))
        return [self._close(0)] if len(self.open) > OPEN else []

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self._close(0) for _ in range(len(self.open))]

    def _close(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        pieces, marks, used = self.open.pop(i)
        self.counts["sequences"] += 1
        if used < self.seq_len:  # padding: a document of its own, never trained
            pad = np.zeros(self.seq_len - used, dtype=np.uint8)
            pad[0] = START
            pieces, marks = pieces + [np.full(len(pad), self.pad_id, dtype=np.int64)], marks + [pad]
        return np.concatenate(pieces), np.concatenate(marks)


def held_out_sequences(sequences: int, val_fraction: float) -> int:
    """How many of the last sequences are held out (module doc)."""
    if val_fraction <= 0 or sequences < 2:
        return 0
    return min(sequences - 1, max(1, math.ceil(val_fraction * sequences)))


def describe(counts: dict[str, int], overlong: str) -> str:
    """One line of a chat corpus's counts (the run's data line)."""
    n, what = (counts["truncated"], "cut") if overlong == "truncate" else (counts["dropped"], "dropped")
    return (
        f"chat: {counts['conversations']:,} conversations in {counts['sequences']:,} sequences, {n} longer than "
        f"data.seq_len {what} (data.overlong={overlong}), {counts['untrained']} without assistant tokens left out"
    )


def cache_key(cfg: DataConfig, template: ChatTemplate) -> list:
    """What a chat corpus's cache key adds: the packing and the template."""
    fields = [cfg.messages_field, cfg.prompt_field, cfg.completion_field]
    return ["chat", cfg.seq_len, cfg.overlong, fields, template.text, sorted(template.specials.items())]
