"""Automatic prefix caching in the paged engine (trickles/infer/prefix.py, paged.py, engine.py): 32 requests sharing
prefixes give the same tokens with the cache on and off (full attention, and every layer windowed so blocks slide
out), through preemption and eviction in a pool too small to keep everything; a repeated prompt prefills only its
last block; released blocks are evicted least recently used first; the hits reach the Prometheus counters."""

from __future__ import annotations

import random

import pytest

from trickles.data import ByteTokenizer
from trickles.infer import Sampling
from trickles.infer.engine import Engine, EngineConfig
from trickles.infer.metrics import ServingMetrics
from trickles.infer.prefix import Blocks, block_keys
from trickles.models import ModelConfig, build_model

TOK = ByteTokenizer()
STEPS = 3000


def _model(window=None):
    cfg = ModelConfig(
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=64,
        vocab_size=260,
        max_seq_len=96,
        sliding_window=window,
    )
    return build_model(cfg, seed=1).eval()


def _run(model, caching: bool, blocks: int, count: int = 32):
    """``count`` requests: one of four shared prefixes (9-30 tokens, one the start of another) and a random question,
    1-7 new tokens, greedy and seeded, some with n=2, submitted between iterations at random; their tokens, the
    preemptions, the engine and its metrics."""
    rng = random.Random(0)
    systems = [[rng.randrange(256) for _ in range(k)] for k in (9, 17, 30)]
    systems.append(systems[2][:22] + [7, 7])
    metrics = ServingMetrics()
    engine = Engine(
        model,
        TOK,
        EngineConfig(max_batch=6, block_size=4, num_blocks=blocks, prefill_chunk=12, prefix_caching=caching),
        metrics=metrics,
    )
    requests = []
    for i in range(count):
        prompt = systems[i % 4] + [rng.randrange(256) for _ in range(rng.randrange(0, 6))]
        sampling = Sampling(max_new_tokens=rng.randrange(1, 8), temperature=0.0 if i % 2 else 0.9, seed=i)
        requests.append(engine.submit(prompt, sampling, 2 if i % 7 == 0 else 1))
        for _ in range(rng.randrange(0, 3)):
            engine.step()
    engine.run_until_idle(max_steps=STEPS)
    assert engine.pool.used == 0
    preempted = sum(q.preemptions for r in requests for q in r.sequences)
    return [[c.tokens for c in r.result] for r in requests], preempted, engine, metrics


@pytest.mark.parametrize("window, count", [(None, 32), (6, 16)], ids=["full", "all-windowed"])
def test_requests_sharing_prefixes_equal_with_the_cache_on_and_off(window, count):
    """32 requests (16 with every layer windowed) in a pool of 10 blocks of 4, which holds a few sequences:
    preemption and eviction both happen with the cache on, and prompt tokens are found in it, counted by the
    Prometheus counters. With every layer windowed, blocks that slid out of the window go back to the pool still
    cached, and a sequence reusing them frees again what its window does not reach."""
    model = _model(window)
    off, _, _, _ = _run(model, False, 10, count)
    on, preempted, engine, metrics = _run(model, True, 10, count)
    assert on == off
    blocks = engine.pool.blocks
    assert blocks.hits > 0 and blocks.evicted > 0 and blocks.cached > 0 and preempted > 0
    values = dict(line.rsplit(" ", 1) for line in metrics.text().decode().splitlines() if not line.startswith("#"))
    queries, hits = (
        float(values["trickles_prefix_cache_queries_total"]),
        float(values["trickles_prefix_cache_hits_total"]),
    )
    assert 0 < hits < queries and hits % 4 == 0, (hits, queries)


def test_a_repeated_prompt_prefills_only_its_last_block():
    """A 21-token prompt sent again finds its first 5 blocks (20 tokens) cached: it feeds one token, draws the same
    tokens, and the pool's cache hits count 20; with the cache off it feeds all 21."""
    model = _model()
    prompt = list(range(40, 61))
    for caching, hit in ((True, 20), (False, 0)):
        engine = Engine(model, TOK, EngineConfig(max_batch=2, block_size=4, num_blocks=16, prefix_caching=caching))
        fed = []
        call = engine._call
        engine._call = lambda rows, fed=fed, call=call: (fed.append(sum(n for _, n in rows)), call(rows))[1]
        first = engine.submit(prompt, Sampling(max_new_tokens=5, temperature=0))
        engine.run_until_idle(max_steps=STEPS)
        fed.clear()
        again = engine.submit(prompt, Sampling(max_new_tokens=5, temperature=0))
        engine.run_until_idle(max_steps=STEPS)
        assert again.result[0].tokens == first.result[0].tokens
        assert fed[0] == 21 - hit and engine.pool.blocks.hits == hit
        assert engine.pool.used == 0


def test_released_blocks_are_evicted_least_recently_used_first():
    """Blocks released stay cached; handing out more than the free list holds evicts the one released first (a
    sequence's last block goes before its first), and a lookup then finds the prefix only up to the evicted block."""
    pool = Blocks(6, 2)
    a, b = list(range(10, 17)), list(range(20, 29))  # 3 and 4 full blocks to share (the last token never is)
    ta = [pool.take() for _ in range(4)]
    pool.register(ta, a, 7, [], 0)  # its first 3 blocks are full
    for blk in reversed(ta):  # released last block first, as BlockPool.release does
        pool.drop(blk)
    tb = [pool.take() for _ in range(3)]  # the free list (2 never used, a's partial block) first: nothing evicted
    assert pool.evicted == 0 and pool.cached == 3 and pool.free == 3 and ta[3] in tb
    tb.append(pool.take())  # now the least recently released cached block: a's third
    assert pool.evicted == 1 and tb[3] == ta[2]
    pool.register(tb, b, 8, [], 0)
    shared = pool.share(a, [])
    assert shared == ta[:2] and pool.hits == 4  # a's first two blocks still cached, its third evicted
    assert pool.share(b, []) == tb and pool.cached == 6
    for blk in shared + tb + tb:
        pool.drop(blk)
    assert pool.free == 6


def test_block_keys_name_the_whole_prefix():
    """A block's key depends on every token before it, not only its own."""
    one, two = block_keys([1, 2, 3, 4], 2, [], 2), block_keys([9, 2, 3, 4], 2, [], 2)
    assert one[0] != two[0] and one[1] != two[1] and block_keys([1, 2, 3, 4, 5], 2, [], 2) == one
