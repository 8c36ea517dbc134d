"""Chat messages to a prompt: the tokenizer's chat template when it has one, the plain template otherwise.

A chat template (Hugging Face's ``chat_template``, a Jinja template kept with a Hugging Face tokenizer's files) is
rendered as ``transformers``' ``apply_chat_template`` renders it: in a sandboxed Jinja environment with
``messages``, ``add_generation_prompt=True``, ``bos_token``/``eos_token`` and ``raise_exception``. ``bos_token`` is
the BOS text of a Hugging Face model directory's tokenizer (``trickles serve DIR``) or of the copy a trickles run
saved of one (its special tokens kept), empty for the byte and BPE tokenizers trained here; the rendered text is
then encoded without adding special tokens, as transformers' ``apply_chat_template(tokenize=True)`` encodes it.

**The plain template** (tokenizers without one: the byte and BPE tokenizers trained here)::

    <|system|>
    {content}
    <|user|>
    {content}
    <|assistant|>
    {content}<|end|>
    <|assistant|>

one block per message (``<|{role}|>``, a line break, the content, a line break; an assistant turn ends with
``<|end|>``), then ``<|assistant|>`` and a line break for the reply. The markers are plain text, so any tokenizer
encodes them; a model trained on such transcripts answers after the last line.
"""

from __future__ import annotations

from collections.abc import Sequence

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ROLES", "render_chat", "plain_template"]

ROLES = ("system", "user", "assistant", "developer")  #: roles a message may have ("developer": OpenAI's newer "system")


def plain_template(messages: Sequence[dict]) -> str:
    """The plain template (see the module's notes)."""
    parts = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        end = "<|end|>" if role == "assistant" else ""
        parts.append(f"<|{role}|>\n{m['content']}{end}\n")
    return "".join(parts) + "<|assistant|>\n"


def render_chat(messages: Sequence[dict], tokenizer) -> str:
    """The prompt text of ``messages`` (``{"role", "content"}`` each, content already text). ValueError when the
    template refuses them (its ``raise_exception``)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return plain_template(messages)

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    eos = getattr(tokenizer, "eos_token", None)
    try:
        return env.from_string(template).render(
            messages=list(messages),
            add_generation_prompt=True,
            bos_token=getattr(tokenizer, "bos_token", None) or "",
            eos_token=eos or "",
        )
    except TemplateError as e:
        raise ValueError(f"the tokenizer's chat template failed: {e}") from None
