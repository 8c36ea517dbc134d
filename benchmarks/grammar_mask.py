"""Per-token grammar mask time of the grammar libraries on our tokenizers: xgrammar vs llguidance vs outlines-core.

What is compared
    Structured output (``response_format`` in ``trickles serve``) fills, at every step of a constrained sequence, the
    bitmask of the tokens its JSON grammar allows next, then advances the grammar by the token drawn. This script
    times both for each library installed, on three tokenizers:

    * ``byte``: trickles' byte tokenizer (257 ids);
    * ``bpe``: a byte-level BPE (GPT-2's and Llama 3's kind) trained here with ``--vocab`` ids;
    * ``sentencepiece``: a sentencepiece-style BPE (Llama 2's and Mistral's kind: ``▁`` for a space, ``<0xNN>`` byte
      fallback tokens, three specials) trained here with ``--vocab`` ids,

    both trained with the ``tokenizers`` library on the standard library's Python files (offline), every library
    reading the same token bytes (:func:`trickles.infer.grammar.vocabulary_bytes`). Grammars: ``json_object`` (any
    JSON object) and four schemas (an object with required fields and a string's ``maxLength``, an enum, an array of
    integers, and a nested tool-call-like object).

How
    Each grammar has example documents (``json.dumps`` of valid values, its default separators); each document is
    tokenized by the tokenizer and fed token by token, as a model drawing it would: mask, then advance. Agreement
    first: every library must accept every token of every document and then allow end-of-text; one that refuses a
    token fails the run. ``--repeat`` walks over all documents; the first is untimed. Reported per library and
    tokenizer: the median and 99th percentile of the mask's time per token, the advance's median, the grammar's
    compile time (median and slowest over the grammars; the tokenizer info, built once beforehand, apart). The pick:
    among the libraries that compile every grammar within ``--compile-limit`` seconds (a request waits for its
    grammar before its first token; a compiled grammar is cached, but every new schema pays it), the one with the lowest
    median mask time summed over the tokenizers.

Examples::

    python benchmarks/grammar_mask.py                        # all three libraries, vocab 32000
    python benchmarks/grammar_mask.py --vocab 2000 --repeat 2 --json /tmp/gm.json
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import statistics
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import device_name, table, write_json  # noqa: E402

from trickles.data import ByteTokenizer, train_bpe  # noqa: E402
from trickles.data.tokenizers import HFTokenizer  # noqa: E402
from trickles.infer.grammar import Grammars, JsonFormat, vocabulary_bytes  # noqa: E402

LIBRARIES = ("xgrammar", "llguidance", "outlines_core")

SCHEMAS: dict[str, tuple[dict | None, list]] = {
    "json_object": (None, [{"a": 1, "b": [True, None, "x y"]}, {"name": "trickles", "tags": {"k": -2.5e3}}]),
    "object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer"},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "age", "ok"],
        },
        [{"name": "Ada Lovelace", "age": 36, "ok": True}, {"name": "", "age": -1, "ok": False}],
    ),
    "enum": ({"enum": ["red", "green", "blue", "ultraviolet"]}, ["red", "ultraviolet"]),
    "integers": ({"type": "array", "items": {"type": "integer"}}, [[1, 22, 333, -4444], [], [7]]),
    "tool_call": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                        "units": {"enum": ["metric", "imperial"]},
                        "hours": {"type": "array", "items": {"type": "number"}},
                    },
                    "required": ["city", "units"],
                },
            },
            "required": ["name", "arguments"],
        },
        [
            {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3, "units": "metric", "hours": [6.5, 12]}},
            {"name": "lookup", "arguments": {"city": "São Paulo", "units": "imperial"}},
        ],
    ),
}


def corpus(max_chars: int) -> list[str]:
    """The standard library's Python files, in name order, until ``max_chars`` characters."""
    out, n = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append(f.read())
        n += len(out[-1])
        if n >= max_chars:
            break
    return out


def continuation(tokenizer):
    """How ``tokenizer`` tokenizes text that continues a prompt: a sentencepiece-style one without the ``▁`` it puts
    before the first word of a text (a model's reply begins mid-text)."""
    if not hasattr(tokenizer, "tk") or "Metaspace" not in tokenizer.tk.to_str():
        return tokenizer.encode
    from tokenizers import Tokenizer, pre_tokenizers

    tk = Tokenizer.from_str(tokenizer.tk.to_str())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    return lambda text: tk.encode(text, add_special_tokens=False).ids


def sentencepiece_style(documents: list[str], vocab: int) -> HFTokenizer:
    """A Llama-2-style tokenizer: BPE over ``▁``-joined words, byte fallback tokens ``<0x00>..<0xFF>`` (ids 3..258,
    ordinary vocabulary), specials ``<unk> <s> </s>``, a decoder that drops the first leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tk.train_from_iterator(
        documents, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    )
    spec = json.loads(tk.to_str())
    spec["added_tokens"] = spec["added_tokens"][:3]  # the byte tokens are ordinary ones (decoded, not skipped)
    return HFTokenizer(Tokenizer.from_str(json.dumps(spec)), "</s>", "hf", f"sentencepiece-{vocab}")


class _Library:
    """One grammar library behind four calls: ``compile(schema)``, ``matcher(grammar)``, ``fill(m)`` (the bitmask of
    what ``m`` allows next into ``self.mask``), ``accept(m, token)`` (False when refused)."""

    def __init__(self, tokenizer):
        self.table, self.special = vocabulary_bytes(tokenizer)
        self.vocab, self.eos, self.tokenizer = tokenizer.vocab_size, tokenizer.eos_id, tokenizer
        self.mask = torch.full((1, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def allows(self, token: int) -> bool:
        return bool((self.mask[0, token // 32] >> (token % 32)) & 1)


class XGrammar(_Library):
    """xgrammar as ``trickles serve`` runs it (:class:`~trickles.infer.grammar.Grammars`: its tokenizer info, its
    string characters narrowed to JSON's); the info is built by compiling a first, trivial grammar."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.grammars = Grammars(tokenizer, self.vocab)
        self.grammars.compile(JsonFormat.of({"type": "null"}))

    def compile(self, schema):
        fmt = JsonFormat.of(schema)
        self.grammars.compile(fmt)
        return fmt

    def matcher(self, grammar):
        return self.grammars.matchers(grammar, 1)[0]  # (the compiled grammar from the cache)

    def fill(self, m):
        m.fill(self.mask, 0)

    def accept(self, m, token):
        return m.accept(token)


class LLGuidance(_Library):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        encode = continuation(tokenizer)

        class Wrapped:  # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id, tokens, special_token_ids = self.eos, None, self.table, self.special

            def __call__(self, text):
                return encode(text if isinstance(text, str) else text.decode("utf-8", "replace"))

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()), n_vocab=self.vocab)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema or {"type": "object"})
        return self.ll.LLMatcher(self.tok, grammar)  # (the grammar compiles here; a copy per sequence after)

    def matcher(self, grammar):
        return grammar.deep_copy()

    def fill(self, m):
        self.ll.torch.fill_next_token_bitmask(m, self.mask)

    def accept(self, m, token):
        return m.consume_token(token)


class OutlinesCore(_Library):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        import outlines_core

        self.oc = outlines_core
        ids: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.table):
            if b and i != self.eos:
                ids.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(self.eos, ids)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema or {"type": "object"}))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, grammar):
        return self.oc.Guide(grammar)

    def fill(self, m):
        m.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)

    def accept(self, m, token):
        m.advance(token, return_tokens=False)
        return True


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines_core": OutlinesCore}


def walk(lib: _Library, grammar, tokens: list[int], times: dict[str, list[float]]) -> str | None:
    """Feeds ``tokens`` to a fresh matcher, timing every mask and advance; the first refusal, or None."""
    m = lib.matcher(grammar)
    for k, tok in enumerate(tokens + [lib.eos]):
        t0 = time.perf_counter()
        lib.fill(m)
        t1 = time.perf_counter()
        if not lib.allows(tok):
            return f"token {k} ({lib.table[tok]!r}) not allowed"
        if tok == lib.eos:
            break
        ok = lib.accept(m, tok)
        t2 = time.perf_counter()
        if ok is False:
            return f"token {k} ({lib.table[tok]!r}) refused"
        times["mask"].append(t1 - t0)
        times["advance"].append(t2 - t1)
    return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=32000, help="ids of the two trained tokenizers")
    p.add_argument("--corpus-chars", type=int, default=3_000_000, help="characters they are trained on")
    p.add_argument("--repeat", type=int, default=20, help="walks over every document (the first untimed)")
    p.add_argument("--compile-limit", type=float, default=1.0, help="seconds a grammar may take to compile")
    p.add_argument("--json", default=None, help="write the numbers here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    docs = corpus(args.corpus_chars)
    tokenizers = {
        "byte": ByteTokenizer(),
        "bpe": train_bpe(docs, args.vocab),
        "sentencepiece": sentencepiece_style(docs, args.vocab),
    }
    present = [name for name in LIBRARIES if importlib.util.find_spec(name) is not None]
    for name in present:  # (imported before any clock runs)
        importlib.import_module(name)
    for name in LIBRARIES:
        if name not in present:
            print(f"{name}: not installed (pip install {name.replace('_', '-')}), left out")
    rows, results = [], {}
    for tname, tok in tokenizers.items():
        for name in present:
            t0 = time.perf_counter()
            lib = ADAPTERS[name](tok)
            info_s = time.perf_counter() - t0
            encode = continuation(tok)
            times: dict[str, list[float]] = {"mask": [], "advance": []}
            compile_s = []
            for gname, (schema, values) in SCHEMAS.items():
                t0 = time.perf_counter()
                grammar = lib.compile(schema)
                compile_s.append(time.perf_counter() - t0)
                for r in range(args.repeat):
                    scratch = {"mask": [], "advance": []}
                    for value in values:
                        error = walk(lib, grammar, encode(json.dumps(value, ensure_ascii=False)), scratch)
                        if error:
                            print(f"{name} on {tname}: {gname} document {json.dumps(value)}: {error}")
                            return 1
                    if r > 0 or args.repeat == 1:
                        for key in times:
                            times[key] += scratch[key]
            mask = sorted(times["mask"])
            out = {
                "tokenizer_info_s": info_s,
                "compile_median_s": statistics.median(compile_s),
                "compile_max_s": max(compile_s),
                "mask_median_s": statistics.median(mask),
                "mask_p99_s": mask[min(len(mask) - 1, int(0.99 * len(mask)))],
                "advance_median_s": statistics.median(times["advance"]),
                "tokens": len(mask),
            }
            results.setdefault(tname, {})[name] = out
            rows.append(
                [
                    f"{tname} ({tok.vocab_size})",
                    name,
                    f"{1e6 * out['mask_median_s']:.1f}",
                    f"{1e6 * out['mask_p99_s']:.1f}",
                    f"{1e6 * out['advance_median_s']:.1f}",
                    f"{1e3 * out['compile_median_s']:.1f}",
                    f"{1e3 * out['compile_max_s']:.1f}",
                    f"{1e3 * info_s:.0f}",
                ]
            )
    quick = [n for n in present if all(results[t][n]["compile_max_s"] <= args.compile_limit for t in results)]
    total = {n: sum(results[t][n]["mask_median_s"] for t in results) for n in quick}
    pick = min(quick, key=total.__getitem__) if quick else None
    print(f"{device_name(torch.device('cpu'))}, one thread, {len(SCHEMAS)} grammars, --repeat {args.repeat}")
    header = ["tokenizer", "library", "mask us p50", "mask us p99", "advance us", "compile ms", "max ms", "info ms"]
    print(table(header, rows))
    slow = ", ".join(n for n in present if n not in quick) or "none"
    print(
        f"pick: {pick} (lowest median mask time summed over the tokenizers among the libraries compiling every "
        f"grammar within {args.compile_limit:g} s; slower: {slow})"
    )
    write_json(args.json, {"device": device_name(torch.device("cpu")), "results": results, "pick": pick})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
