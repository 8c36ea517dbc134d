"""The continuous-batching engine (trickles/infer/engine.py) over the paged KV cache (trickles/infer/paged.py): every
request's tokens equal the request decoded alone, the scheduling it promises (from the iterations it records, not
wall clocks), and every KV block back in the pool after requests that finish, are cancelled or fail."""

from __future__ import annotations

import random
import time

import pytest
import torch

from trickles.data import ByteTokenizer
from trickles.infer import Sampling, decode
from trickles.infer.engine import Cancelled, Engine, EngineConfig, PoolStalled, PoolTooSmall
from trickles.infer.paged import BlockPool, PagedCall
from trickles.models import ModelConfig, build_model

TOK = ByteTokenizer()
STEPS = 2000  # iterations any test here needs, many times over: an engine still busy after them fails, never hangs


def _model(flavor="llama", context=64):
    kv = {"n_kv_heads": 2} if flavor == "llama" else {}
    cfg = ModelConfig(
        flavor=flavor, n_layers=2, d_model=32, n_heads=4, ffn_hidden=64, vocab_size=260, max_seq_len=context, **kv
    )
    return build_model(cfg, seed=0).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.mark.parametrize("flavor", ["llama", "gpt2"])
def test_32_requests_arriving_at_random_equal_each_request_alone(flavor):
    """32 requests of 1-29 prompt tokens and 1-19 new ones, greedy and seeded sampling (some with a repetition penalty,
    some with n=2), submitted between iterations at random: each choice's tokens equal :func:`decode` of that
    request alone, token for token. The pool (12 blocks of 4) is small enough that sequences are preempted and
    recomputed on the way (asserted), and every block is free at the end."""
    model = _model(flavor)
    engine = Engine(model, TOK, EngineConfig(max_batch=8, block_size=4, num_blocks=12, prefill_chunk=16))
    rng = random.Random(0)
    requests = []
    for i in range(32):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        sampling = Sampling(
            max_new_tokens=rng.randrange(1, 20),
            temperature=0.0 if i % 2 == 0 else 0.9,
            seed=i,
            repetition_penalty=1.2 if i % 3 == 0 else 1.0,
            top_k=0 if i % 4 else 20,
        )
        n = 2 if i % 5 == 0 else 1
        requests.append((prompt, sampling, n, engine.submit(prompt, sampling, n)))
        for _ in range(rng.randrange(0, 3)):
            engine.step()
    engine.run_until_idle(max_steps=STEPS)
    for prompt, sampling, n, request in requests:
        seeds = [Sampling(**{**sampling.__dict__, "seed": sampling.seed + j}) for j in range(n)]
        alone = decode(model, [prompt] * n, seeds, eos_id=TOK.eos_id, tokenizer=TOK)
        assert [c.tokens for c in request.result] == [c.tokens for c in alone], (prompt, sampling)
        assert [c.finish_reason for c in request.result] == [c.finish_reason for c in alone]
    preempted = [s for *_, r in requests for s in r.sequences if s.preemptions]
    assert preempted and all(s.admitted_step <= s.first_token_step for s in preempted)  # the first admission kept
    assert engine.pool.used == 0 and not engine.running and not engine.waiting


def test_a_paged_call_reads_what_a_dense_cache_holds(model):
    """Rows with different cached lengths in scattered blocks: the new keys land in their rows' blocks, every row's
    positions are gathered in order (slot = position) into one head-major buffer, and the mask lets each query see
    exactly its row's positions up to its own."""
    pool = BlockPool(model, num_blocks=8, block_size=2)
    layer = next(iter(pool.k))
    heads, slots, dim = pool.k[layer].shape
    pool.k[layer].copy_(torch.arange(slots, dtype=torch.float32)[None, :, None].expand_as(pool.k[layer]))
    call = PagedCall(pool, [[5, 2], [7], [1, 6, 3]], cached=[2, 0, 4], new=[1, 2, 1])
    k = torch.full((3, heads, 2, dim), -1.0)
    keys, _ = call.update(layer, 0, k, torch.zeros_like(k))
    assert (call.width, call.slots) == (2, 5) and keys.shape == (3, heads, 5, dim)
    assert keys.stride(0) < keys.stride(1)  # stored head-major: the model's attention takes it without a copy
    assert call.positions.tolist() == [[1, 2], [0, 1], [3, 4]]  # a padding query sits at a cached position
    assert keys[:, 0, :, 0].tolist() == [
        [10, 11, -1, 5, 0],  # blocks 5, 2 (its position 2 written), then masked
        [-1, -1, 0, 1, 0],  # block 7, both positions new
        [2, 3, 12, 13, -1],
    ]  # blocks 1, 6, 3 (position 4 written)
    assert call.pad_mask.shape == (3, 1, 2, 5)
    assert call.pad_mask[:, 0, 1].tolist() == [[True] * 3 + [False] * 2, [True] * 2 + [False] * 3, [True] * 5]
    assert pool.k[layer][0, [4, 14, 15, 6], 0].tolist() == [-1.0] * 4  # written in place


def test_a_short_request_finishes_before_a_long_one_and_a_late_one_starts_at_once(model):
    """A long request decodes; a short one submitted after it finishes first, and a request arriving mid-generation
    draws its first token while the long one is still running (iterations recorded by the engine)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=4, block_size=4))
    long = engine.submit([1, 2, 3], Sampling(max_new_tokens=40, temperature=0))
    for _ in range(5):
        engine.step()
    short = engine.submit([4, 5], Sampling(max_new_tokens=3, temperature=0))
    engine.run_until_idle(max_steps=STEPS)
    (lq,), (sq,) = long.sequences, short.sequences
    assert lq.finish_reason == "length" and sq.finish_reason == "length"
    assert sq.finished_step < lq.finished_step
    assert sq.arrived_step == sq.admitted_step == 5 and sq.first_token_step == 5 < lq.finished_step
    assert lq.admitted_step == 0
    assert len(sq.generated) == 3 and len(lq.generated) == 40


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(model):
    """With prefill_chunk=8 a 40-token prompt takes 5 iterations to prefill, and a running sequence draws a token in
    every one of them (it is never stalled for the whole prompt)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=4, block_size=4, prefill_chunk=8))
    running = engine.submit([7], Sampling(max_new_tokens=30, temperature=0))
    engine.step()
    before = len(running.sequences[0].generated)
    long = engine.submit(list(range(40)), Sampling(max_new_tokens=2, temperature=0))
    for i in range(5):
        engine.step()
        assert len(running.sequences[0].generated) == before + i + 1
        # 8 prompt tokens an iteration; in the fifth the prompt is done, its first token drawn and fed at once
        assert long.sequences[0].cached == (8 * (i + 1) if i < 4 else 41)
    assert long.sequences[0].first_token_step == engine.steps - 1
    engine.run_until_idle(max_steps=STEPS)
    [alone] = decode(model, [list(range(40))], Sampling(max_new_tokens=2, temperature=0), eos_id=TOK.eos_id)
    assert long.result[0].tokens == alone.tokens


def test_blocks_return_to_the_pool_after_cancelled_and_failed_requests(model):
    """A cancelled request, one whose model call fails and one whose sampling fails end (Cancelled / the error) and
    free their blocks; the requests beside them are served; the pool is empty at the end."""
    calls = {"n": 0}

    def logits(z):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return z

    engine = Engine(model, TOK, EngineConfig(max_batch=4, block_size=4), logits_fn=logits)
    a = engine.submit([1, 2, 3, 4, 5], Sampling(max_new_tokens=20, temperature=0))
    b = engine.submit([9, 9], Sampling(max_new_tokens=20, temperature=0))
    engine.step()  # one prefill call, one decode call
    assert engine.pool.used == 3
    engine.step()  # the third call fails: the requests in it fail
    assert isinstance(a.result, RuntimeError) and isinstance(b.result, RuntimeError) and engine.pool.used == 0
    c = engine.submit([3], Sampling(max_new_tokens=20, temperature=0))
    d = engine.submit([4], Sampling(max_new_tokens=5, temperature=0))
    engine.step()
    assert engine.pool.used > 0
    c.cancel()
    engine.run_until_idle(max_steps=STEPS)
    assert isinstance(c.result, Cancelled) and c.sequences[0].finish_reason == "cancelled"
    assert [x.finish_reason for x in d.result] == ["length"] and engine.pool.used == 0
    # a row whose own settings break its sampling (logits / 1e-300 overflow to inf) fails alone, in the same batch
    e = engine.submit([5, 6], Sampling(max_new_tokens=5, temperature=1e-300, seed=0), n=2)
    f = engine.submit([7], Sampling(max_new_tokens=5, temperature=0.5, seed=0))
    engine.run_until_idle(max_steps=STEPS)
    assert isinstance(e.result, RuntimeError) and "probability tensor" in str(e.result)
    assert [x.finish_reason for x in f.result] == ["length"] and engine.pool.used == 0


def test_a_prompt_larger_than_the_pool_is_refused_and_budgets_fit_the_pool(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=2, block_size=4, num_blocks=3))
    with pytest.raises(PoolTooSmall, match="the prompt is 12 tokens; the KV pool holds 12 positions"):
        engine.submit(list(range(12)), Sampling(max_new_tokens=1))
    r = engine.submit(list(range(8)), Sampling(max_new_tokens=30, temperature=0))
    engine.run_until_idle(max_steps=STEPS)
    assert len(r.result[0].tokens) == 4 and r.result[0].finish_reason == "length"  # 8 + 4 = the pool's 12 positions


def test_a_request_that_can_never_be_admitted_fails_instead_of_waiting_forever(model):
    """A block lost to no sequence (a leak, made here by hand) leaves a request that needs the whole pool unable to
    run: once nothing runs it fails with :class:`PoolStalled` naming the lost block, and the engine serves the next
    request; a bounded drain of a busy engine raises instead of looping."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, block_size=4, num_blocks=4))
    lost: list[int] = []
    assert engine.pool.grow(lost, 1)  # one block held by no sequence
    big = engine.submit(list(range(12)), Sampling(max_new_tokens=4, temperature=0))  # 16 positions: 4 blocks
    small = engine.submit([1], Sampling(max_new_tokens=2, temperature=0))
    engine.run_until_idle(max_steps=STEPS)
    assert isinstance(big.result, PoolStalled), big.result
    assert "needs 4 KV blocks, 3 of 4 are free" in str(big.result) and "1 blocks are held by no sequence" in str(
        big.result
    )
    assert [c.finish_reason for c in small.result] == ["length"] and engine.steps < 20
    engine.pool.release(lost)
    assert engine.pool.used == 0
    engine.submit([1], Sampling(max_new_tokens=50, temperature=0))
    with pytest.raises(RuntimeError, match="still busy after 3 iterations"):
        engine.run_until_idle(max_steps=3)


def test_events_stream_tokens_and_text_and_the_worker_thread_serves(model):
    """``Engine.generate`` yields the tokens as they are drawn and their text; with the worker thread started,
    ``Request.events`` does the same from another thread; ``stop`` fails what is still waiting."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, block_size=4))
    events = list(engine.generate([65, 66], Sampling(max_new_tokens=6, temperature=0)))
    tokens = [e.token for e in events if e.token is not None]
    assert len(tokens) == 6 and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == TOK.decode(tokens)
    step = engine.step

    def slow_step():  # 60 iterations of at least 5 ms: the request is surely running when its first event is read
        time.sleep(0.005)
        step()

    engine.step = slow_step
    engine.start()
    request = engine.submit([65, 66], Sampling(max_new_tokens=60, temperature=0))
    stream = request.events(timeout=60)
    first = next(stream)
    assert not request.finished  # woken by the event, not by the end of the request
    threaded = [first, *stream]
    assert [e.token for e in threaded if e.token is not None][:6] == tokens
    engine.stop()
    left = engine.submit([1], Sampling(max_new_tokens=4))
    engine.stop()
    assert isinstance(left.result, RuntimeError) and engine.pool.used == 0
