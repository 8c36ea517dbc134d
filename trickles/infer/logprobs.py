"""Token log-probabilities as the serving engine computes them and as OpenAI's API shapes them.

**What they are.** The model's raw next-token distribution, ``log_softmax(z)`` of its logits ``z`` in fp32, before any
penalty, temperature or top-k/top-p (what vLLM returns by default): the same numbers whatever the request's sampling
settings. A drawn token's :class:`TokenLogprob` holds its own log-probability and the ``N`` most likely tokens' (the
request's ``logprobs`` / ``top_logprobs``), most likely first, with the drawn token appended when it is not among them
(OpenAI's rule, "up to logprobs + 1 elements"), so the list always holds the chosen token and stays sorted.

**In the batch.** :func:`raw_logprobs` takes the rows that ask for them before the penalties change the logits,
:func:`pack` gathers the chosen tokens' values and one ``topk`` at the largest ``N`` asked into the tensor that carries
the drawn tokens to the host, so a step with logprobs makes the one device-to-host transfer a step makes anyway;
:func:`unpack` reads it back. Rows without logprobs share the batch and cost nothing more. Prompt tokens (``echo``)
come from the prefill's logits at every position (:func:`prompt_records`, one transfer per prefill chunk).

**OpenAI's shapes.** :func:`completion_logprobs`: the legacy completions' ``tokens``, ``token_logprobs``,
``top_logprobs`` (a dict per token, token text to log-probability) and ``text_offset`` (each token's character offset
in the choice's text, the echoed prompt included: a running sum of the token texts' lengths, as vLLM's).
:func:`chat_logprobs`: ``content``, per token ``token``, ``logprob``, ``bytes``, ``top_logprobs``. A token's text is the
tokenizer's decoding of it alone (part of a UTF-8 character decodes to U+FFFD, as in vLLM; a special token is named);
its ``bytes`` are that text's UTF-8, except for the byte tokenizer, whose token is one byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..data.tokenizers import ByteTokenizer

__all__ = [
    "TokenLogprob",
    "chat_logprobs",
    "completion_logprobs",
    "pack",
    "prompt_records",
    "raw_logprobs",
    "token_bytes",
    "token_text",
    "unpack",
]


@dataclass
class TokenLogprob:
    """One token's log-probability under the model, and the most likely tokens at its position."""

    token: int  #: the token id
    logprob: float  #: its log-probability
    top: list[tuple[int, float]]  #: ``(id, log-probability)``, most likely first, ``token`` included


def _record(token: int, logprob: float, ids: Sequence[float], values: Sequence[float]) -> TokenLogprob:
    top = [(int(i), float(v)) for i, v in zip(ids, values)]
    if all(i != token for i, _ in top):
        top.append((token, logprob))
    return TokenLogprob(token, logprob, top)


def raw_logprobs(logits: torch.Tensor, wants: Sequence[int | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, log_softmax(logits[rows]) in fp32)`` for the rows whose ``wants`` is not None; None if no row's is."""
    rows = [i for i, w in enumerate(wants) if w is not None]
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    return index, logits.index_select(0, index).float().log_softmax(-1)


def pack(chosen: torch.Tensor, raw: tuple[torch.Tensor, torch.Tensor] | None, wants: Sequence[int | None]):
    """The drawn tokens ``chosen [B]`` as a ``[B, 2 + 2K]`` float64 tensor (ids are exact in it): column 0 the
    token, then for the rows of ``raw`` (:func:`raw_logprobs`) its log-probability, the ``K = max N`` most likely ids
    and their values; just ``chosen`` when ``raw`` is None."""
    if raw is None:
        return chosen
    index, lp = raw
    k = min(max(w for w in wants if w is not None), lp.shape[-1])
    out = torch.zeros(len(wants), 2 + 2 * k, dtype=torch.float64, device=chosen.device)
    out[:, 0] = chosen
    out[index, 1] = lp.gather(1, chosen.index_select(0, index)[:, None])[:, 0].double()
    if k:
        values, ids = lp.topk(k, dim=-1)
        out[index, 2 : 2 + k] = ids.double()
        out[index, 2 + k :] = values.double()
    return out


def unpack(packed: torch.Tensor, wants: Sequence[int | None]) -> tuple[list[int], list[TokenLogprob | None]]:
    """The tokens and, for the rows that asked, their :class:`TokenLogprob` s, from :func:`pack` (one transfer)."""
    rows = packed.tolist()
    if packed.dim() == 1:
        return rows, [None] * len(rows)
    k = (packed.shape[1] - 2) // 2
    tokens, records = [], []
    for row, n in zip(rows, wants):
        tok = int(row[0])
        tokens.append(tok)
        records.append(None if n is None else _record(tok, row[1], row[2 : 2 + n], row[2 + k : 2 + k + n]))
    return tokens, records


def prompt_records(logits: torch.Tensor, targets: Sequence[int], n: int) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of each of ``targets`` under the logits ``[len(targets), V]`` of the positions before
    them, with the ``n`` most likely (one transfer)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(list(targets), device=lp.device)[:, None]).double()
    k = min(n, lp.shape[-1])
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0])
    rows = torch.cat([chosen, ids.double(), values.double()], dim=1).tolist()
    return [_record(t, row[0], row[1 : 1 + k], row[1 + k :]) for t, row in zip(targets, rows)]


def token_text(tokenizer, token: int) -> str:
    """The text of ``token`` decoded alone; a special token that decodes to nothing by its name."""
    text = tokenizer.decode([token])
    if text:
        return text
    if token == tokenizer.eos_id:
        return getattr(tokenizer, "eos_token", None) or "<|endoftext|>"
    tk = getattr(tokenizer, "tk", None)
    return (tk.id_to_token(token) if tk is not None else None) or ""


def token_bytes(tokenizer, token: int) -> list[int]:
    """The bytes of ``token``: the byte itself for the byte tokenizer, else its text's UTF-8."""
    if isinstance(tokenizer, ByteTokenizer) and 0 <= token < 256:
        return [token]
    return list(token_text(tokenizer, token).encode("utf-8"))


def completion_logprobs(
    tokenizer,
    records: Sequence[TokenLogprob],
    prompt: Sequence[int] | None = None,
    prompt_records: Sequence[TokenLogprob] | None = None,
    start: int = 0,
) -> dict:
    """The legacy completions' ``logprobs`` of ``records`` (after the echoed ``prompt``'s tokens, the first with null
    values, when given), offsets counted from ``start``; ``end`` is the offset after the last token (a token adds the
    length of its decoded text, none for a special token)."""
    entries: list[tuple[int, TokenLogprob | None]] = []
    if prompt:
        entries = [(prompt[0], None), *((r.token, r) for r in prompt_records or ())]
    entries += [(r.token, r) for r in records]
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, r in entries:
        out["tokens"].append(token_text(tokenizer, tok))
        out["text_offset"].append(start)
        start += len(tokenizer.decode([tok]))
        out["token_logprobs"].append(None if r is None else r.logprob)
        top: dict[str, float] | None = None
        if r is not None:
            top = {}
            for t, v in r.top:  # two ids with one text: the likelier one's value
                top.setdefault(token_text(tokenizer, t), v)
        out["top_logprobs"].append(top)
    return {**out, "end": start}


def chat_logprobs(tokenizer, records: Sequence[TokenLogprob]) -> dict:
    """Chat completions' ``logprobs``: ``{"content": [...]}``, one entry per token of ``records``."""

    def entry(t: int, v: float) -> dict:
        return {"token": token_text(tokenizer, t), "logprob": v, "bytes": token_bytes(tokenizer, t)}

    return {
        "content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records]
    }
