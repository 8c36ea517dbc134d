"""The OpenAI request bodies the server takes and the answers it gives (``/v1/completions``, ``/v1/chat/completions``).

Requests carry OpenAI's fields that apply, plus ``top_k`` and ``repetition_penalty`` (as vLLM takes them): among them
``presence_penalty`` and ``frequency_penalty`` in [-2, 2], a completion's ``logprobs`` (0-20) and ``echo``, a chat's
``logprobs`` and ``top_logprobs`` (0-20, only with ``logprobs``), and both endpoints' ``response_format``: ``text``
(free), ``json_object`` or ``json_schema`` with its ``schema`` (the reply's tokens drawn under a JSON grammar,
:mod:`.grammar`; a schema the grammar library cannot compile is refused when the request is submitted, a 400). Any
other field is refused by name and every value must have its field's JSON type, so a typo never silently changes
decoding. Every text must be encodable: a JSON string may spell a lone surrogate (``"\\ud800"``), which no UTF-8
tokenizer takes, so it is refused by field. Numbers are bounded where decoding would overflow: ``seed`` fits a
generator's 64 bits, a ``repetition_penalty`` lies in [0.01, 100], and a temperature below :data:`GREEDY_BELOW`
decodes greedily (its limit; dividing the logits by it would overflow, as vLLM also does). Answers are OpenAI's
shapes: a completion's choices carry ``text`` (after the prompt's with ``echo``), a chat completion's ``message``
(``delta`` when streamed, the first chunk of each choice carrying ``role``), both ``logprobs`` when asked
(:mod:`.logprobs`); ``usage`` counts prompt and generated tokens.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .chat import ROLES
from .decode import Completion, Sampling
from .grammar import JsonFormat

__all__ = ["CompletionRequest", "ChatRequest", "ChatMessage", "completion_body", "chat_body", "usage", "GREEDY_BELOW"]

GREEDY_BELOW = 1e-5  #: a temperature below this decodes greedily


def _encodable(value):
    """``value`` (a string, or a list of them) if every string is valid Unicode; ValueError otherwise."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else ():
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"text must be valid Unicode: character {e.start} is a lone surrogate "
                    f"({text[e.start]!r}), which UTF-8 cannot encode"
                ) from None
    return value


class _Body(BaseModel):
    """A request body's part: unknown fields refused, types strict (``"2"`` is no integer and ``"yes"`` no boolean;
    an integer is a number), every string field encodable."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _valid_text(cls, v):
        return _encodable(v)


class _StreamOptions(_Body):
    include_usage: bool = False


class _JsonSchema(_Body):
    """OpenAI's ``json_schema`` format: ``schema`` is enforced (``strict`` is accepted; the schema is always applied
    strictly, see :mod:`.grammar`)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")  #: a JSON Schema
    strict: bool | None = None


class _ResponseFormat(_Body):
    """``response_format``: ``text`` (free, the default), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('give json_schema with type "json_schema", and only then')
        return self

    def format(self) -> JsonFormat | None:
        """The :class:`~.grammar.JsonFormat` asked for (None: free text)."""
        if self.type == "text":
            return None
        return JsonFormat.of(self.json_schema.schema_ if self.json_schema is not None else None)


class _Sampled(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100)
    presence_penalty: float = Field(0.0, ge=-2, le=2)  #: OpenAI's, over the tokens generated so far
    frequency_penalty: float = Field(0.0, ge=-2, le=2)  #: OpenAI's, times each token's count so far
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: _StreamOptions | None = None  #: ``include_usage``: a last chunk with the usage, no choices
    user: str | None = None  #: accepted and ignored (OpenAI's end-user id)
    response_format: _ResponseFormat | None = None  #: structured output: JSON, or JSON under a schema (:mod:`.grammar`)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        if v is not None and any(not s for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must not be empty")
        return v

    def sampling(self, default_tokens: int) -> Sampling:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        tokens = self.max_tokens if self.max_tokens is not None else default_tokens
        return Sampling(
            max_new_tokens=tokens,
            temperature=self.temperature if self.temperature >= GREEDY_BELOW else 0.0,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            stop=stop,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            response_format=self.response_format.format() if self.response_format is not None else None,
        )


class CompletionRequest(_Sampled):
    """The body of ``POST /v1/completions`` (``max_tokens`` defaults to 16, as OpenAI's)."""

    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)  #: each token's log-probability and the N most likely
    echo: bool = False  #: the prompt's text (and, with ``logprobs``, its tokens) before the completion's

    def sampling(self, default_tokens: int) -> Sampling:
        out = super().sampling(default_tokens)
        out.logprobs, out.prompt_logprobs = self.logprobs, self.logprobs if self.echo else None
        return out


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message: a role and its text (a string, or a list of text parts)."""

    role: str
    content: str | list[_TextPart] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v):
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; use one of {', '.join(ROLES)}")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampled):
    """The body of ``POST /v1/chat/completions`` (``max_completion_tokens`` is OpenAI's newer ``max_tokens``;
    without either, the reply may fill the context)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False  #: each token's log-probability (``top_logprobs``: and the N most likely)
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: set logprobs to true to use top_logprobs")
        return self

    def sampling(self, default_tokens: int) -> Sampling:
        out = super().sampling(default_tokens)
        out.logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return out

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, v):
        if not v:
            raise ValueError("give at least one message")
        return v


def usage(results: list[Completion]) -> dict:
    prompt = sum(c.prompt_tokens for c in results)
    completion = sum(len(c.tokens) for c in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(head: dict, results: list[Completion]) -> dict:
    return {
        **head,
        "choices": [
            {"text": c.text, "index": i, "logprobs": None, "finish_reason": c.finish_reason}
            for i, c in enumerate(results)
        ],
        "usage": usage(results),
    }


def chat_body(head: dict, results: list[Completion]) -> dict:
    return {
        **head,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(results)
        ],
        "usage": usage(results),
    }
