"""What a Hugging Face tokenizer directory says beside ``tokenizer.json``: its end-of-text and other special tokens,
its chat template, and the configuration files a saved copy keeps.

``tokenizer_config.json`` and ``special_tokens_map.json`` are read as transformers reads them (the config first; a
token given as ``{"content": ...}`` or as its text). :meth:`trickles.data.tokenizers.HFTokenizer.save` writes both
back as the source directory had them (the end-of-text token and the chat template set to the tokenizer's own), so a
checkpoint's copy renders a chat template exactly as the source directory does -- with its ``bos_token``, say -- in
``trickles generate``, ``serve`` and ``eval`` and in transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import json
import os
from typing import Any

COMMON_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # what a saved copy keeps of its source's


def config_files(directory: str) -> dict[str, dict]:
    """``{file name: its JSON object}`` of the directory's :data:`CONFIG_FILES` that exist and hold one."""
    out = {}
    for name in CONFIG_FILES:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                table = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(table, dict):
            out[name] = table
    return out


def token_text(value: Any) -> str | None:
    """A special token's text as a config file gives it (a string, or a dict with ``content``)."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def saved_config(files: dict[str, dict], eos_token: str, chat_template: str | None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` a copy writes: its source's (``files``, :func:`config_files`), or a minimal one,
    with ``eos_token`` and the chat template set to the tokenizer's own."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **files.get("tokenizer_config.json", {})}
    if token_text(config.get("eos_token")) != eos_token:
        config["eos_token"] = eos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def find_chat_template(directory: str) -> str | None:
    """The chat template of a Hugging Face tokenizer directory: ``chat_template.jinja``, else ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates: the one named ``default``, else the first)."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def find_eos(directory: str, tk: Any) -> str | None:
    """The eos token named by the directory's config files, else the first common name it knows."""
    eos = find_special(directory, tk, "eos_token")
    return eos if eos is not None else next((n for n in COMMON_EOS if tk.token_to_id(n) is not None), None)


def find_special(directory: str, tk: Any, which: str) -> str | None:
    """The special token ``which`` (``eos_token``, ``bos_token``) the directory's config files name, if a token."""
    files = config_files(directory)
    for name in CONFIG_FILES:
        text = token_text(files.get(name, {}).get(which))
        if text is not None and tk.token_to_id(text) is not None:
            return text
    return None
