"""A Hugging Face chat template rendered for training: the text of a conversation and which of its tokens train.

The template is rendered as ``transformers``' ``apply_chat_template`` renders it: a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, ``tojson``, ``raise_exception`` and
``strftime_now``, the tokenizer's special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, as its
``tokenizer_config.json`` names them) and ``messages``; the text is then encoded without adding special tokens.

**Which tokens train** (:meth:`ChatTemplate.conversation`): character spans of the rendered text, and every token whose
characters overlap a span (``token_start < span_end`` and ``token_end > span_start``, offsets as the tokenizer reports
them) -- transformers' rule for its assistant mask.

* A template with ``{% generation %} ... {% endgeneration %}`` blocks: the spans are the blocks' rendered text, so the
  positions are exactly ``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``'s
  ``assistant_masks``.
* A template without: for each assistant message ``k``, the span runs from the end of the rendering of messages
  ``0..k-1`` with the generation prompt (``add_generation_prompt=True``: the assistant's role header) to the end of
  the rendering of messages ``0..k`` -- the message's content and whatever the template closes its turn with (an
  end-of-turn token, a line break). Both renderings must be prefixes of the whole conversation's rendering;
  a template that rewrites earlier turns (drops past reasoning, say) is refused and needs generation blocks.

**Prompt/completion records** (:meth:`ChatTemplate.prompt_completion`), as TRL's ``SFTTrainer`` tokenizes them: text
prompt and completion -- ``prompt`` and ``prompt + completion + eos`` (the eos text added unless the completion ends
with it) each encoded with the tokenizer's special tokens (a BOS where its post-processor adds one), no chat
template; message lists -- ``prompt`` and ``prompt + completion`` each rendered by the template (no generation
prompt). In both, the tokens after the prompt's own token count train.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import datetime

import jinja2
import numpy as np
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import DataError
from .tokenizers import HFTokenizer

SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")  # the special tokens a template sees by name
_GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
_spans: ContextVar[list | None] = ContextVar("generation_spans", default=None)


class _Generation(Extension):
    """``{% generation %} ... {% endgeneration %}``: records the character span of the block's output."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller):
        text = caller()
        tracking = _spans.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def special_tokens(directory: str, tokenizer: HFTokenizer) -> dict[str, str]:
    """The special tokens' texts a tokenizer directory's ``tokenizer_config.json`` / ``special_tokens_map.json``
    name (``eos_token`` at least: the tokenizer's own)."""
    out: dict[str, str] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # (the config wins, as transformers reads it)
        try:
            with open(os.path.join(directory, fname), encoding="utf-8") as f:
                table = json.load(f)
        except (OSError, ValueError):
            continue
        for key in SPECIALS:
            value = table.get(key) if isinstance(table, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
    out.setdefault("eos_token", tokenizer.eos_token)
    return out


class ChatTemplate:
    """A tokenizer's chat template, compiled once; ``specials``: the special tokens' texts it sees."""

    def __init__(self, tokenizer: HFTokenizer, template: str, specials: dict[str, str]):
        self.tokenizer, self.text, self.specials = tokenizer, template, dict(specials)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.compiled = env.from_string(template)
        except jinja2.TemplateError as e:
            raise DataError(f"the tokenizer's chat template does not compile ({e}); fix chat_template") from None
        self.has_generation = _GENERATION.search(template) is not None  # (transformers' test)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> tuple[str, list]:
        """``(text, generation spans)`` of ``messages``; DataError (the template's message) when it refuses them."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _spans.set((blocks, spans))
        try:
            for block in self.compiled.generate(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **self.specials
            ):
                blocks.append(block)
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template refused the conversation: {e}") from None
        finally:
            _spans.reset(token)
        return "".join(blocks), spans

    def spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and its trained character spans (module doc)."""
        text, spans = self.render(messages)
        if self.has_generation:
            return text, spans
        spans = []
        for k, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True)[0]
            upto = self.render(messages[: k + 1])[0]
            if not (text.startswith(before) and text.startswith(upto) and len(before) <= len(upto)):
                raise DataError(
                    f"the chat template does not render the conversation incrementally (the text up to message {k + 1} "
                    "is not the start of the whole); give the template {% generation %} blocks around assistant text"
                )
            spans.append((len(before), len(upto)))
        return text, spans

    def conversation(self, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, trained)`` of a conversation: int64 token ids and a bool per token (module doc)."""
        text, spans = self.spans(messages)
        enc = self.tokenizer.tk.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int64), overlap_mask(enc.offsets, spans)

    def prompt_completion(self, prompt, completion) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, trained)`` of a prompt/completion record (module doc): strings, or lists of messages."""
        if isinstance(prompt, str):
            eos = self.specials["eos_token"]
            completion = completion if completion.endswith(eos) else completion + eos
            head = self.tokenizer.tk.encode(prompt, add_special_tokens=True).ids
            ids = self.tokenizer.tk.encode(prompt + completion, add_special_tokens=True).ids
        else:
            encode = self.tokenizer.tk.encode
            head = encode(self.render(prompt)[0], add_special_tokens=False).ids
            ids = encode(self.render(list(prompt) + list(completion))[0], add_special_tokens=False).ids
        trained = np.zeros(len(ids), dtype=bool)
        trained[len(head) :] = True
        return np.asarray(ids, dtype=np.int64), trained


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """A bool per token: its characters ``offsets[i]`` overlap one of the sorted ``spans`` (transformers' rule)."""
    out = np.zeros(len(offsets), dtype=bool)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            out[i] = True
    return out
