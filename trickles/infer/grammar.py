"""Structured output: every token of a constrained sequence drawn under a JSON grammar, a per-sequence logits mask
filled by the xgrammar library.

**What a request asks.** ``response_format`` (:mod:`.protocol`) becomes a :class:`JsonFormat`: ``{"type":
"json_object"}`` any JSON object, ``{"type": "json_schema", "json_schema": {"schema": ...}}`` a JSON value valid under
the schema (xgrammar's ``strict_mode``, as vLLM's: an object takes no property its schema does not name, an array no
item its schema does not describe). Whitespace is free between JSON's tokens and nowhere else (not before the
value, not after it).

**Compiled once.** :class:`Grammars` (one per engine) reads the tokenizer's vocabulary into xgrammar's tokenizer info
on first use (:func:`vocabulary_bytes`: the bytes each id stands for, byte-level BPE and sentencepiece-style alike),
and compiles each format once (an LRU cache of ``cache_size`` formats; a request of ``n`` choices compiles once and
gets ``n`` matchers). A schema xgrammar cannot compile is refused at submission with its message on one line
(:class:`GrammarError`, a ValueError: the server answers 400).

**Each step** (:func:`constrain`, called first by :func:`~.sampler.draw`): the bitmask of what each constrained
row's matcher allows next is filled on the host, one row per constrained sequence (free rows cost nothing), and the
disallowed tokens' logits of those rows become ``-inf``, before the log-probabilities, penalties, temperature and
top-k/p -- vLLM V1's order, so a constrained row's logprobs are those of the masked distribution (a disallowed
token's is reported as -9999.0, as vLLM's API reports ``-inf``). After the draw, :func:`advance` moves each matcher
by its row's token. Once the value is complete the grammar allows only the end-of-text token, so a reply ends with
``finish_reason: "stop"``; one cut by its token budget ends with ``"length"`` (its text then is not whole JSON), and
so may one cut by a stop string.

**State.** A sequence's matcher lives as long as the sequence and only ever sees its drawn tokens, so recompute
preemption (which re-feeds the tokens drawn so far to the model, not to the grammar) keeps it as it is.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from dataclasses import dataclass

import torch

from ..data.tokenizers import ByteTokenizer

__all__ = ["GrammarError", "Grammars", "JsonFormat", "Matcher", "advance", "constrain", "vocabulary_bytes", "MISSING"]

MISSING = "structured output (response_format) needs the xgrammar library: pip install xgrammar"
HIDDEN_LOGPROB = -9999.0  #: the log-probability reported for a token the grammar forbids (vLLM's)


#: xgrammar's character of a JSON string (of any string, and of one with a length limit), which lets surrogate code
#: points through (U+D800-U+DFFF: not UTF-8) and, with a length limit, control characters (RFC 8259: they are
#: escaped); every grammar compiled here has JSON's character in their place
_LOOSE_CHARACTERS = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]")
_JSON_CHARACTER = r"[^\0-\x1f\"\\\ud800-\udfff]"


class GrammarError(ValueError):
    """A format the grammar library cannot compile (the message says why, on one line)."""


@dataclass(frozen=True)
class JsonFormat:
    """A reply constrained to JSON (hashable: the compile cache's key)."""

    schema: str | None = None  #: a JSON Schema as JSON text (``json_schema``); None: any JSON object (``json_object``)

    @classmethod
    def of(cls, schema: dict | None) -> JsonFormat:
        """The format of ``schema`` (None: any object); the properties keep their order (the replies' order)."""
        return cls(None if schema is None else json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(MISSING) from None
    return xgrammar


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable bytes stand for themselves, the others are shifted to
    ``256 + k`` (the ``tokenizers`` library's ``ByteLevel`` pre-tokenizer and decoder)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(shifted)}}


_BYTE_LEVEL = _byte_level_alphabet()


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in decoder.get("decoders", ())))
    if decoder.get("type") == "Replace" and (decoder.get("pattern") or {}).get("String") == "▁":
        return {"Metaspace"}  # (Llama's: a Replace of '▁' by ' ' where newer files have a Metaspace)
    return {decoder.get("type")}


def vocabulary_bytes(tokenizer) -> tuple[list[bytes], list[int]]:
    """``(table, special)``: the bytes each token id of ``tokenizer`` stands for (``b""`` for a special token) and the
    special ids. A byte-level BPE's token is its characters read through GPT-2's byte alphabet; a sentencepiece-style
    one's (a ``Metaspace`` decoder or a ``Replace`` of ``▁``, byte fallback) has ``▁`` for a space and ``<0xNN>`` for
    byte NN; any other token is its text's UTF-8."""
    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) for i in range(256)] + [b""] * (tokenizer.vocab_size - 256), [tokenizer.eos_id]
    tk = getattr(tokenizer, "tk", None)
    if tk is None:
        raise GrammarError(f"structured output needs a byte or Hugging Face tokenizer, not {type(tokenizer).__name__}")
    spec = json.loads(tk.to_str())
    kinds = _decoder_kinds(spec.get("decoder"))
    added = {a["id"]: a for a in spec.get("added_tokens") or ()}
    special = sorted(i for i, a in added.items() if a.get("special"))
    table = [b""] * tokenizer.vocab_size
    for text, i in tk.get_vocab(with_added_tokens=True).items():
        if i in added:
            table[i] = b"" if added[i].get("special") else text.encode("utf-8")
        elif "ByteLevel" in kinds and all(c in _BYTE_LEVEL for c in text):
            table[i] = bytes(_BYTE_LEVEL[c] for c in text)
        elif "ByteFallback" in kinds and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            table[i] = bytes([int(text[3:5], 16)])
        elif "Metaspace" in kinds:
            table[i] = text.replace("▁", " ").encode("utf-8")
        else:
            table[i] = text.encode("utf-8")
    return table, special


def _one_line(error: BaseException) -> str:
    """xgrammar's message without its source-location prefix (``[time] file.cc:123: ``), on one line."""
    text = re.sub(r"\[[0-9:]+\] \S+:\d+: ", "", str(error))
    return "; ".join(line.strip() for line in text.splitlines() if line.strip()) or type(error).__name__


class Matcher:
    """One sequence's grammar state: what it allows next (:meth:`fill`) and the tokens it took (:meth:`accept`)."""

    def __init__(self, matcher):
        self._m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row ``row`` of the int32 ``bitmask`` (bit ``t % 32`` of word
        ``t // 32`` set for an allowed ``t``)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Moves past ``token``; False (and no move) if the grammar does not allow it."""
        return self._m.accept_token(token)

    @property
    def complete(self) -> bool:
        """The value is whole (only the end-of-text token may follow)."""
        return self._m.is_completed()


class Grammars:
    """The engine's grammars over ``tokenizer`` for logits of ``vocab_size`` ids (the model's; ids the tokenizer does
    not have are never allowed). Nothing is imported or read until the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._compiler = None
        self._cache: collections.OrderedDict[JsonFormat, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  #: formats compiled so far (cache misses)

    def _compiler_for(self, xgr):
        if self._compiler is None:
            if self.tokenizer is None:
                raise GrammarError("structured output needs the tokenizer of the model; give the engine one")
            table, _ = vocabulary_bytes(self.tokenizer)
            table = (table + [b""] * self.vocab_size)[: self.vocab_size]  # the model's ids: b"" is never allowed
            info = xgr.TokenizerInfo(
                table, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=[self.tokenizer.eos_id]
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, fmt: JsonFormat):
        """The compiled grammar of ``fmt`` (cached); :class:`GrammarError` if it cannot be compiled."""
        xgr = _xgrammar()
        with self._lock:
            if fmt in self._cache:
                self._cache.move_to_end(fmt)
                return self._cache[fmt]
            compiler = self._compiler_for(xgr)
            try:
                schema, strict = ('{"type": "object"}', False) if fmt.schema is None else (fmt.schema, True)
                ebnf = str(xgr.Grammar.from_json_schema(schema, strict_mode=strict))
                for loose in _LOOSE_CHARACTERS:
                    ebnf = ebnf.replace(loose, _JSON_CHARACTER)
                grammar = compiler.compile_grammar(ebnf)
            except (RuntimeError, ValueError) as e:
                raise GrammarError(f"response_format: the JSON schema cannot be used: {_one_line(e)}") from None
            self.compiled += 1
            self._cache[fmt] = grammar
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return grammar

    def matchers(self, fmt: JsonFormat | None, n: int, speculative: bool = False) -> list[Matcher | None]:
        """``n`` fresh matchers of ``fmt``, one per choice of a request (``n`` Nones without a format). Refused with
        ``speculative`` decoding, whose drafts a matcher would have to take and give back."""
        if fmt is None:
            return [None] * n
        if speculative:
            raise GrammarError(
                "response_format: structured output does not combine with speculative decoding; "
                "serve without --speculative to constrain replies"
            )
        grammar = self.compile(fmt)
        xgr = _xgrammar()
        return [Matcher(xgr.GrammarMatcher(grammar)) for _ in range(n)]


def constrain(seqs, logits: torch.Tensor) -> list[tuple[object, BaseException]]:
    """Sets to ``-inf`` the logits of row ``i`` of ``logits [B, V]`` that the grammar of ``seqs[i]`` forbids, for
    the sequences that have one (``grammar`` not None); returns the sequences whose grammar allows no token at all,
    with their error (their rows are zeroed, so that drawing from them cannot fail: they are to be dropped)."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return []
    vocab = logits.shape[-1]
    bitmask = torch.zeros(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for k, i in enumerate(rows):
        seqs[i].grammar.fill(bitmask, k)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    stuck = [k for k, any_ in enumerate(allowed.any(dim=1).tolist()) if not any_]
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill_(~allowed.to(logits.device), float("-inf"))
    masked[stuck] = 0
    logits.index_copy_(0, index, masked)
    return [(seqs[rows[k]], RuntimeError("the response_format grammar allows no next token")) for k in stuck]


def advance(seqs, tokens: list[int], skip: set[int]) -> list[tuple[object, BaseException]]:
    """Moves the grammar of each of ``seqs`` that has one (and whose ``id`` is not in ``skip``) past its token; the
    sequences whose grammar refused it (never, for a token its mask allowed), with their error."""
    failed = []
    for s, tok in zip(seqs, tokens):
        if s.grammar is not None and id(s) not in skip and not s.grammar.accept(tok):
            failed.append((s, RuntimeError(f"the response_format grammar refused token {tok}, which it allowed")))
    return failed
