"""Speculative decoding in the paged engine (trickles/infer/speculative.py): greedy output equal to plain decoding
over 32 requests with n-gram and draft-model proposals (through preemption in a small pool, penalties, n=2, prefix
caching of the accepted tokens only); the acceptance rule's output following the target's distribution (chi-square,
on the rule itself and end to end through the engine); the n-gram lookup; the counters; the refusals."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from trickles.data import ByteTokenizer
from trickles.infer import Sampling
from trickles.infer.engine import Engine, EngineConfig
from trickles.infer.metrics import ServingMetrics
from trickles.infer.speculative import NgramIndex, accept_drafts, accept_greedy
from trickles.models import ModelConfig, build_model
from trickles.models.generate import sample_probs

TOK = ByteTokenizer()
STEPS = 3000


def _model(layers=2, vocab=260, seed=1, context=96, window=None):
    cfg = ModelConfig(
        n_layers=layers,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=64,
        vocab_size=vocab,
        max_seq_len=context,
        sliding_window=window,
    )
    return build_model(cfg, seed=seed).eval()


MODEL = _model()


def _truncated(model, layers: int):
    """``model`` with only its first ``layers`` blocks: a draft that agrees with it part of the time."""
    draft = copy.deepcopy(model)
    for name in list(draft.layers)[layers:]:
        del draft.layers[name]
    draft.cfg = dataclasses.replace(draft.cfg, n_layers=layers)
    return draft


def _prompts(count: int = 32):
    """Prompts that repeat a short random piece (so n-grams recur), some the beginning of another's prompt plus its
    first continuation (so prefix-cached blocks written while speculating are shared), with their settings."""
    rng = random.Random(0)
    out = []
    for i in range(count):
        piece = [rng.randrange(256) for _ in range(rng.randrange(2, 6))]
        prompt = (piece * 5)[: rng.randrange(5, 22)]
        sampling = Sampling(
            max_new_tokens=rng.randrange(2, 12), temperature=0, repetition_penalty=1.3 if i % 5 == 0 else 1.0
        )
        out.append((prompt, sampling, 2 if i % 7 == 0 else 1))
    return out


def _run(prompts, metrics=None, model=MODEL, **spec):
    engine = Engine(
        model, TOK, EngineConfig(max_batch=6, block_size=4, num_blocks=12, prefill_chunk=12, **spec), metrics=metrics
    )
    rng = random.Random(1)
    requests = []
    for prompt, sampling, n in prompts:
        requests.append(engine.submit(prompt, sampling, n))
        for _ in range(rng.randrange(0, 3)):
            engine.step()
    engine.run_until_idle(max_steps=STEPS)
    assert engine.pool.used == 0
    preempted = sum(q.preemptions for r in requests for q in r.sequences)
    return [[c.tokens for c in r.result] for r in requests], preempted, engine


@pytest.fixture(scope="module")
def plain():
    # the second half continues the first half's prompts with their whole replies: the blocks written while
    # speculating on the first half (replies included) are looked up in the prefix cache by these
    prompts = _prompts()
    first, _, _ = _run(prompts[:16])
    for j in range(16, 32):
        prompts[j] = (prompts[j - 16][0] + first[j - 16][0] + [7], prompts[j][1], prompts[j][2])
    out, _, _ = _run(prompts)
    return prompts, out


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_output_equals_plain_decoding(plain, kind):
    """32 greedy requests (some with a repetition penalty, some n=2) in a pool of 12 blocks of 4: the tokens are plain
    decoding's; sequences are preempted while speculating; drafts are proposed and accepted, and counted by the
    Prometheus counters; prefix caching reuses blocks written by verifying calls."""
    prompts, expected = plain
    spec = {"speculative": kind, "num_speculative_tokens": 3}
    if kind == "draft":
        spec["draft_model"] = _truncated(MODEL, 1)
    metrics = ServingMetrics()
    out, preempted, engine = _run(prompts, metrics, **spec)
    assert out == expected
    assert preempted > 0 and engine.pool.blocks.hits > 0
    assert 0 < engine.spec.accepted < engine.spec.drafted
    values = dict(line.rsplit(" ", 1) for line in metrics.text().decode().splitlines() if not line.startswith("#"))
    assert float(values["trickles_spec_decode_draft_tokens_total"]) == engine.spec.drafted
    assert float(values["trickles_spec_decode_accepted_tokens_total"]) == engine.spec.accepted


def test_greedy_output_equals_plain_decoding_with_every_layer_windowed():
    """Every layer windowed (window 6, blocks of 4): blocks slide out as verifying calls of several tokens run."""
    model = _model(seed=2, window=6)
    prompts = _prompts(16)
    plain, _, _ = _run(prompts, model=model)
    out, _, engine = _run(prompts, model=model, speculative="draft", draft_model=model, num_speculative_tokens=3)
    assert out == plain and engine.spec.accepted > 0 and engine.pool.slide_window == 6


def test_a_draft_equal_to_the_target_is_always_accepted_and_stops_apply_in_order():
    """With the target as its own draft every draft is accepted (K + 1 tokens a step); a budget, a stop string and
    the end-of-text token cut the tokens emitted in one step where they fall."""
    prompt = TOK.encode("abcabcab")
    alone = Engine(MODEL, TOK, EngineConfig(block_size=4))
    spec = Engine(MODEL, TOK, EngineConfig(block_size=4, speculative="draft", draft_model=MODEL))
    for sampling in (Sampling(max_new_tokens=13, temperature=0), Sampling(max_new_tokens=30, temperature=0)):
        [a] = alone.submit(prompt, sampling).sequences
        alone.run_until_idle(STEPS)
        [b] = spec.submit(prompt, sampling).sequences
        spec.run_until_idle(STEPS)
        assert b.completion() == a.completion()
    assert spec.spec.accepted == spec.spec.drafted > 0
    text = TOK.decode(a.completion().tokens)
    assert len(text) >= 7 and a.completion().finish_reason == "length"
    stop = text[5:7]
    results = []
    for engine in (alone, spec):
        results.append(engine.submit(prompt, Sampling(max_new_tokens=30, temperature=0, stop=(stop,))))
        engine.run_until_idle(STEPS)
    for r in results:
        assert r.result[0].text == text[: text.index(stop)] and r.result[0].finish_reason == "stop"
    assert spec.pool.used == 0 and alone.pool.used == 0


def test_logprobs_penalties_and_seeds_under_speculation():
    """A greedy request's logprobs are plain decoding's (each emitted token's raw log-softmax and top 3); a seeded
    sampled request with every penalty gives the same tokens at every run, whichever proposer."""
    prompt = TOK.encode("abcabcab")
    greedy = Sampling(max_new_tokens=12, temperature=0, logprobs=3)
    seeded = Sampling(
        max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=0.3,
    )  # fmt: skip
    alone = Engine(MODEL, TOK, EngineConfig(block_size=4)).submit(prompt, greedy)
    alone.engine.run_until_idle(STEPS)
    [want] = alone.result
    for spec in ({"speculative": "ngram"}, {"speculative": "draft", "draft_model": MODEL}):
        engine = Engine(MODEL, TOK, EngineConfig(block_size=4, **spec))
        runs = [engine.submit(prompt, s) for s in (greedy, seeded, seeded)]
        engine.run_until_idle(STEPS)
        [got], [one], [two] = (r.result for r in runs)
        assert got.tokens == want.tokens
        assert engine.spec.accepted > 0 or spec["speculative"] == "ngram"  # (the target as its own draft: all kept)
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert one.tokens == two.tokens and len(one.tokens) == 12


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square test's p-value of ``counts`` against ``probs`` (cells with an expected count under 5 pooled)."""
    expected = probs.double().flatten() * counts.sum()
    counts = counts.double().flatten()
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum()[None]])
    c = torch.cat([counts[~small], counts[small].sum()[None]])
    keep = e > 0
    stat = float(((c[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 8, "too few cells with an expected count of 5: draw more"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("proposer", ["sampled", "point"])
def test_the_acceptance_rule_emits_the_targets_distribution(proposer):
    """A Markov chain over 8 tokens as the target (p(b | a)), drafts of 3 tokens from another chain q (sampled) or its
    argmax (a point mass, as n-gram lookup proposes): the first two tokens emitted, over 6000 runs, follow
    p(a) p(b | a) (chi-square, p-value > 0.001), and not q's."""
    g = torch.Generator().manual_seed(0)
    v = 8
    p0, p = torch.rand(v, generator=g).softmax(0), (2 * torch.rand(v, v, generator=g)).softmax(-1)
    q0, q = torch.rand(v, generator=g).softmax(0), (2 * torch.rand(v, v, generator=g)).softmax(-1)
    counts = torch.zeros(v, v)
    for _ in range(6000):
        out: list[int] = []
        while len(out) < 2:  # steps of speculation until two tokens are out
            drafts, dq = [], []
            for _ in range(3):
                prev = (out + drafts)[-1] if out or drafts else None
                dist = q0 if prev is None else q[prev]
                x = int(torch.multinomial(dist, 1, generator=g)) if proposer == "sampled" else int(dist.argmax())
                drafts.append(x)
                dq.append(dist)

            def p_at(i, drafts=drafts, out=out):
                seq = out + drafts[:i]
                return p0 if not seq else p[seq[-1]]

            out += accept_drafts(p_at, drafts, torch.stack(dq) if proposer == "sampled" else None, g)
        counts[out[0], out[1]] += 1
    target = p0[:, None] * p
    assert _chi2_pvalue(counts, target) > 1e-3
    assert _chi2_pvalue(counts, q0[:, None] * q) < 1e-6


def test_accept_greedy_keeps_drafts_while_they_are_the_argmax():
    top = [5, 6, 7, 8]
    assert accept_greedy(top.__getitem__, [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_greedy(top.__getitem__, [5, 9, 7]) == [5, 6]
    assert accept_greedy(top.__getitem__, []) == [5]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_sampled_tokens_through_the_engine_follow_the_target(kind):
    """A random model over 6 tokens, 400 seeded choices of one prompt sampled at temperature 0.7 with top-k 5
    through the speculating engine: the first token ``a`` comes from the prefill, ``b`` from a verifying call (a draft
    accepted or the token drawn instead), ``c`` from it too (the bonus) or the next step; the pairs ``(a, b)`` and
    ``(b, c)`` follow the target's ``p(b | a) p(c | a, b)`` (times the first token's observed frequency: chi-square)."""
    model = _model(vocab=6, seed=3, context=32)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # (n-grams: "1 2" was followed by 3, "2 3" by 1)
    spec = {"speculative": kind, "num_speculative_tokens": 2, "ngram_min": 1}
    if kind == "draft":
        spec["draft_model"] = _model(layers=1, vocab=6, seed=4, context=32)
    engine = Engine(model, None, EngineConfig(max_batch=100, block_size=4, **spec))
    sampling = Sampling(max_new_tokens=3, temperature=0.7, top_k=5, seed=0)
    request = engine.submit(prompt, sampling, n=400)
    engine.run_until_idle(STEPS)
    got = torch.tensor([c.tokens for c in request.result])
    assert engine.spec.drafted > 0 and 0 < engine.spec.accepted < engine.spec.drafted
    counts = torch.zeros(6, 6, 6)
    for a, b, c in got.tolist():
        counts[a, b, c] += 1
    with torch.no_grad():
        rows = torch.tensor([prompt + [a, b] for a in range(6) for b in range(6)])
        z = model(rows)[:, -3:].float()  # logits after the prompt, after a, after b
    p_b = sample_probs(z[::6, 1], 0.7, 5).reshape(6, 6)  # p(b | a)
    p_c = sample_probs(z[:, 2], 0.7, 5).reshape(6, 6, 6)  # p(c | a, b)
    first = counts.sum((1, 2)) / counts.sum()  # the prefill's token, not speculated: its own frequency
    joint = first[:, None, None] * p_b[:, :, None] * p_c
    assert _chi2_pvalue(counts.sum(2), joint.sum(2)) > 1e-3  # (a, b)
    assert _chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # (b, c)


def test_ngram_lookup_takes_the_longest_latest_suffix_and_reads_on():
    index = NgramIndex(1, 3)
    assert index.propose([1, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # "1 2 3" last followed by 4 (before: 9)
    index = NgramIndex(1, 3)
    assert index.propose([1, 2, 3, 9, 5, 2, 3, 4, 1, 2, 3], 2) == [9, 5]  # the longest suffix first: not "2 3" -> 4
    index = NgramIndex(1, 3)
    assert index.propose([5, 6, 7, 5, 6], 4) == [7, 5, 6, 7]  # past the end: the proposal itself
    assert index.propose([5, 6, 7, 5, 6, 8], 2) == []  # 8 never occurred before
    index = NgramIndex(2, 2)
    assert index.propose([4, 1, 4], 3) == []  # below ngram_min: no match


def test_settings_are_refused_in_one_line():
    for spec, words in (
        ({"speculative": "medusa"}, "speculative must be one of ngram, draft"),
        ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be at least 1"),
        ({"speculative": "ngram", "ngram_min": 3, "ngram_max": 2}, "need 1 <= ngram_min <= ngram_max"),
        ({"speculative": "draft"}, "needs a draft model"),
        ({"speculative": "draft", "draft_model": _model(vocab=64)}, "a draft must share the target's tokenizer"),
    ):
        with pytest.raises(ValueError, match=words):
            Engine(MODEL, TOK, EngineConfig(**spec))
