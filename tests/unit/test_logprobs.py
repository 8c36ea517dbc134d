"""Log-probabilities and OpenAI's penalties in the continuous-batching engine (trickles/infer/sampler.py,
trickles/infer/logprobs.py): in a batch mixing requests with and without them, every drawn and every prompt token's
log-probability equals the model's own log-softmax over the whole sequence, the most likely tokens are sorted and
hold the chosen one, requests without them get the tokens they get alone, and presence and frequency penalties
change greedy tokens exactly as OpenAI's formula computed by hand on the model's logits says."""

from __future__ import annotations

import collections

import pytest
import torch

from trickles.data import ByteTokenizer
from trickles.infer import Sampling, decode
from trickles.infer.engine import Engine, EngineConfig
from trickles.infer.logprobs import pack, raw_logprobs, unpack
from trickles.infer.static import StaticBackend
from trickles.models import ModelConfig, build_model

TOK = ByteTokenizer()
STEPS = 2000


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=260, max_seq_len=64)
    return build_model(cfg, seed=0).eval()


@torch.no_grad()
def _reference(model, tokens) -> torch.Tensor:
    """The model's log-softmax at every position of ``tokens``, one forward without a cache, fp32."""
    return model(torch.tensor([tokens]))[0].float().log_softmax(-1)


def _check(record, ref_row: torch.Tensor, n: int) -> None:
    """``record`` (a TokenLogprob) against the reference log-softmax row of its position, ``n`` alternatives asked."""
    assert abs(record.logprob - float(ref_row[record.token])) < 1e-5
    values = [v for _, v in record.top]
    assert values == sorted(values, reverse=True) and record.token in [t for t, _ in record.top]
    expect = ref_row.topk(n).indices.tolist() if n else []
    assert [t for t, _ in record.top][:n] == expect
    assert len(record.top) == n + (record.token not in expect)
    for t, v in record.top:
        assert abs(v - float(ref_row[t])) < 1e-5


def test_logprobs_in_a_mixed_batch_equal_the_models_log_softmax(model):
    """Five requests in one engine whose pool (8 blocks of 4) preempts the one asking for prompt logprobs (echo) after
    its prefill, prompts prefilled in chunks of 8: a plain greedy one, that greedy one with prompt logprobs, one
    sampled with top-k and a repetition penalty, one sampled with penalties, one asking for prompt logprobs and no
    new token. Each record equals the reference within 1e-5 (the raw distribution: penalties, temperature and top-k
    do not change it), none is recorded twice; the plain request equals itself decoded alone."""
    engine = Engine(model, TOK, EngineConfig(max_batch=8, block_size=4, num_blocks=8, prefill_chunk=8))
    prompts = [list(f"request {i}: {'x' * (2 * i)}".encode()) for i in range(5)]
    settings = [
        Sampling(max_new_tokens=9, temperature=0),
        Sampling(max_new_tokens=8, temperature=0, logprobs=3, prompt_logprobs=2),
        Sampling(max_new_tokens=8, temperature=0.8, seed=3, top_k=20, repetition_penalty=1.3, logprobs=0),
        Sampling(max_new_tokens=9, temperature=1.0, seed=4, logprobs=5, presence_penalty=1.5, frequency_penalty=-0.5),
        Sampling(max_new_tokens=0, prompt_logprobs=0),
    ]
    requests = [engine.submit(p, s) for p, s in zip(prompts, settings)]
    engine.run_until_idle(max_steps=STEPS)
    assert requests[1].sequences[0].preemptions > 0
    [alone] = decode(model, [prompts[0]], settings[0], eos_id=TOK.eos_id, tokenizer=TOK)
    [plain] = requests[0].result
    assert plain.tokens == alone.tokens and plain.logprobs is None and plain.prompt_logprobs is None
    for prompt, s, request in zip(prompts[1:], settings[1:], requests[1:]):
        [c] = request.result
        ref = _reference(model, prompt + c.tokens)
        if s.logprobs is None:
            assert c.logprobs is None and c.tokens == []
        else:
            assert [r.token for r in c.logprobs] == c.tokens and len(c.tokens) > 0
            for j, r in enumerate(c.logprobs):
                _check(r, ref[len(prompt) - 1 + j], s.logprobs)
        if s.prompt_logprobs is None:
            assert c.prompt_logprobs is None
        else:
            assert [r.token for r in c.prompt_logprobs] == prompt[1:]
            for q, r in enumerate(c.prompt_logprobs):
                _check(r, ref[q], s.prompt_logprobs)
    assert engine.pool.used == 0


def test_presence_and_frequency_penalties_follow_openais_formula(model):
    """Greedy tokens with ``presence_penalty`` 0.7 and ``frequency_penalty`` 0.9 equal those computed by hand from
    the model's logits, ``z[t] -= 0.7 * (count[t] > 0) + 0.9 * count[t]`` over the tokens generated so far (the
    prompt not counted), and differ from the unpenalized tokens; a negative presence penalty follows it too."""
    engine = Engine(model, TOK, EngineConfig(max_batch=4, block_size=4, num_blocks=40))
    prompt = list(b"aaaa bbbb")
    for presence, frequency in ((0.7, 0.9), (-1.5, 0.0)):
        s = Sampling(max_new_tokens=16, temperature=0, presence_penalty=presence, frequency_penalty=frequency)
        penalized, free = engine.submit(prompt, s), engine.submit(prompt, Sampling(max_new_tokens=16, temperature=0))
        engine.run_until_idle(max_steps=STEPS)
        tokens, counts = list(prompt), collections.Counter()
        with torch.no_grad():
            for _ in range(16):
                z = model(torch.tensor([tokens]))[0, -1].float()
                for t, c in counts.items():
                    z[t] -= presence * (c > 0) + frequency * c
                tok = int(z.argmax())
                if tok == TOK.eos_id:
                    break
                tokens.append(tok)
                counts[tok] += 1
        assert penalized.result[0].tokens == tokens[len(prompt) :]
        assert penalized.result[0].tokens != free.result[0].tokens


def test_top_logprobs_are_sorted_and_hold_the_chosen_token():
    """A chosen token outside the N most likely is appended after them (N + 1 entries, still sorted); one inside them
    is not repeated; rows that ask for none share the transfer and get no record."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [5.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    wants = [2, None, 1]
    raw = raw_logprobs(logits, wants)
    tokens, records = unpack(pack(torch.tensor([0, 0, 3]), raw, wants), wants)
    lp = logits.log_softmax(-1)
    assert tokens == [0, 0, 3] and records[1] is None
    assert [t for t, _ in records[0].top] == [1, 2, 0] and abs(records[0].logprob - float(lp[0, 0])) < 1e-7
    assert [t for t, _ in records[2].top] == [3] and abs(records[2].top[0][1] - float(lp[2, 3])) < 1e-7


def test_decode_and_the_static_batcher_refuse_what_only_the_engine_applies(model):
    with pytest.raises(ValueError, match="presence_penalty, logprobs: only the continuous-batching engine"):
        decode(model, [[1, 2]], Sampling(presence_penalty=0.5, logprobs=1))
    static = StaticBackend(model, TOK, max_batch=2, window_s=0.01)
    with pytest.raises(ValueError, match="prompt_logprobs: the static batcher does not apply these"):
        static.submit([1], Sampling(prompt_logprobs=0), on_event=print, on_finish=print)
