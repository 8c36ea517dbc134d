"""Sliding windows in the paged serving engine (trickles/infer/paged.py, engine.py): greedy tokens equal to plain
decoding for a window shorter than prompt + generation, every layer windowed (Mistral) or some (Qwen2), with
chunked prefill and preemption; blocks that slid out of every layer's window go back to the pool while a sequence
runs, so a long generation holds at most ceil(window / block) + 1 blocks; with a full-attention layer none is freed.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from trickles.infer import Sampling, decode
from trickles.infer.engine import Engine, EngineConfig, PoolTooSmall
from trickles.infer.paged import BlockPool, PagedCall
from trickles.models import ModelConfig, build_model

WINDOW, BLOCK, CONTEXT = 6, 4, 96
STEPS = 2000  # iterations any test here needs, many times over: an engine still busy after them fails, never hangs
PATTERNS = {"mistral": None, "qwen2": [False, True], "first-slides": [True, False], "gemma2": [True, False]}
# Gemma 2's attention pieces (local/global alternation as "gemma2"): capped scores take the math path, not SDPA
GEMMA = dict(attn_softcap=5.0, final_softcap=10.0, query_pre_attn_scalar=16.0, rope_local_theta=1000.0)


def _cfg(pattern):
    extra = GEMMA if pattern == "gemma2" else {}
    return ModelConfig(
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=64,
        vocab_size=260,
        max_seq_len=CONTEXT,
        sliding_window=WINDOW,
        window_layers=PATTERNS[pattern],
        **extra,
    )


def _model(pattern):
    return build_model(_cfg(pattern), seed=3).eval()


def _greedy(n):
    return Sampling(max_new_tokens=n, temperature=0)


def _alone(model, prompt, n):
    return decode(model, [prompt], _greedy(n))[0].tokens


@pytest.mark.parametrize("pattern, blocks", [("mistral", 5), ("qwen2", 14), ("first-slides", 14), ("gemma2", 14)])
def test_paged_tokens_equal_plain_decoding_past_the_window(pattern, blocks):
    """Six greedy requests (prompts of 1-23 tokens, 7-40 new ones, windows of 6 far exceeded), submitted between
    iterations at random, prefilled 5 tokens an iteration, in a pool small enough that sequences are preempted and
    recomputed: each equals :func:`decode` of the request alone (the dense cache), and the window matters (the same
    weights without it give other tokens); also under Gemma 2's soft-capped, rescaled scores and local rotary base.
    With every layer windowed a request runs past what the whole pool holds
    (5 blocks of 4), its budget not cut."""
    model = _model(pattern)
    engine = Engine(model, None, EngineConfig(max_batch=4, block_size=BLOCK, num_blocks=blocks, prefill_chunk=5))
    rng = random.Random(7)
    jobs = [(rng.sample(range(256), k), n) for k, n in [(3, 30), (11, 12), (17, 25), (1, 40), (9, 7), (23, 20)]]
    requests = []
    for prompt, n in jobs:
        requests.append(engine.submit(prompt, _greedy(n)))
        for _ in range(rng.randrange(3)):
            engine.step()
    engine.run_until_idle(max_steps=STEPS)
    assert any(s.preemptions for r in requests for s in r.sequences)
    got = [r.result[0].tokens for r in requests]
    assert got == [_alone(model, prompt, n) for prompt, n in jobs]
    full = build_model(dataclasses.replace(_cfg(pattern), sliding_window=CONTEXT), seed=3).eval()  # never cuts
    assert got != [_alone(full, prompt, n) for prompt, n in jobs]
    if pattern == "mistral":
        assert max(len(p) + len(t) for (p, _), t in zip(jobs, got)) > blocks * BLOCK
    assert engine.pool.used == 0


def test_blocks_that_slid_out_of_every_window_return_to_the_pool():
    """Every layer windowed: through 80 generated tokens, and a second sequence decoding beside it, no sequence ever
    holds more than ceil(6 / 4) + 1 = 3 blocks (counted after every block it takes), nor the pool more than 3 per
    running sequence (its free count, read after every iteration), while positions run to 85; the tokens are plain
    decoding's."""
    model = _model("mistral")
    engine = Engine(model, None, EngineConfig(max_batch=2, block_size=BLOCK, num_blocks=6))
    bound, pool, held = math.ceil(WINDOW / BLOCK) + 1, engine.pool, []
    grow = pool.grow

    def counted(table, positions):
        ok = grow(table, positions)
        held.append(pool.held(table))
        return ok

    pool.grow = counted
    long = engine.submit([5, 6, 7, 8, 9], _greedy(80))
    short = None
    while not engine.idle:
        engine.step()
        if engine.steps == 20:
            short = engine.submit([10, 11, 12], _greedy(30))
        assert pool.num_blocks - pool.free <= bound * len(engine.running), engine.steps
        assert engine.steps < STEPS
    assert max(held) == bound and len(held) > 100 and pool.free == pool.num_blocks
    assert not any(s.preemptions for s in (*long.sequences, *short.sequences))
    assert len(long.result[0].tokens) == 80 and long.result[0].tokens == _alone(model, [5, 6, 7, 8, 9], 80)
    assert short.result[0].tokens == _alone(model, [10, 11, 12], 30)


def test_a_prompt_longer_than_the_pool_is_prefilled_in_chunks_beside_the_window():
    """Every layer windowed, 5 blocks of 4 and the default prefill chunk (256): a 50-token prompt goes in chunks of
    (5 - 1) * 4 - 6 + 1 = 11 tokens, the blocks behind the window freed between them, and decodes as alone."""
    model = _model("mistral")
    engine = Engine(model, None, EngineConfig(block_size=BLOCK, num_blocks=5))
    prompt = list(range(100, 150))
    request = engine.submit(prompt, _greedy(10))
    engine.step()
    assert request.sequences[0].cached == 11 and engine.pool.held(request.sequences[0].table) == 2
    engine.run_until_idle(max_steps=STEPS)
    assert request.result[0].tokens == _alone(model, prompt, 10) and engine.pool.free == 5


def test_a_full_attention_layer_keeps_every_block():
    """With one full-attention layer nothing slides out of every window: the sequence holds ceil(L / 4) blocks."""
    engine = Engine(_model("qwen2"), None, EngineConfig(max_batch=1, block_size=BLOCK, num_blocks=24))
    request = engine.submit([5, 6, 7, 8, 9], _greedy(60))
    most = 0
    while not engine.idle:
        engine.step()
        most = max(most, engine.pool.used)
    assert len(request.result[0].tokens) == 60 and most == math.ceil(
        (5 + 60 - 1) / BLOCK
    )  # (the last token drawn is never fed)


def test_a_paged_call_gathers_only_the_window_of_a_windowed_layer():
    """A windowed layer reads the last T + window - 1 positions of each row (freed blocks read as block 0, masked),
    its mask the band q - window < k <= q; a full layer reads every position from 0."""
    model = _model("qwen2")
    pool = BlockPool(model, num_blocks=8, block_size=2)
    full, slid = sorted(pool.k)  # layer 0 full, layer 1 windowed
    for layer in (full, slid):
        pool.k[layer].copy_(torch.arange(16, dtype=torch.float32)[None, :, None].expand_as(pool.k[layer]))
    table = [5, 2, 7, 1, 6]
    pool.slide(table, 9)  # a query at 9 or later sees positions 4.. : blocks of positions 0-3 could go
    assert table == [5, 2, 7, 1, 6]  # a full-attention layer needs them: nothing is freed
    call = PagedCall(pool, [table], cached=[9], new=[1])
    heads, dim = pool.k[full].shape[0], pool.k[full].shape[2]
    k = torch.full((1, heads, 1, dim), -1.0)
    keys, _ = call.update(full, 0, k, torch.zeros_like(k))
    assert keys[0, 0, :, 0].tolist() == [10, 11, 4, 5, 14, 15, 2, 3, 12, -1]
    keys, _ = call.update(slid, 0, k, torch.zeros_like(k))
    assert keys[0, 0, :, 0].tolist() == [14, 15, 2, 3, 12, -1]  # positions 4..9 (9 written)
    assert call.mask(slid)[0, 0, 0].tolist() == [True] * WINDOW
    assert call.mask(full)[0, 0, 0].tolist() == [True] * 10
    windowed, table = BlockPool(_model("mistral"), num_blocks=8, block_size=2), []
    assert windowed.grow(table, 10) and table == [0, 1, 2, 3, 4] and windowed.free == 3
    windowed.slide(table, 9)  # every layer windowed: positions 0-3 go back
    assert table == [-1, -1, 2, 3, 4] and windowed.free == 5 and windowed.held(table) == 3
    windowed.release(table)
    assert windowed.free == 8


def test_a_pool_smaller_than_the_window_is_refused_in_one_line():
    engine = Engine(_model("mistral"), None, EngineConfig(block_size=BLOCK, num_blocks=2))
    with pytest.raises(PoolTooSmall, match="sliding window") as e:
        engine.submit([1, 2, 3], _greedy(4))
    assert "\n" not in str(e.value)
    never_cuts = build_model(dataclasses.replace(_cfg("mistral"), sliding_window=CONTEXT), seed=3).eval()
    engine = Engine(never_cuts, None, EngineConfig(block_size=BLOCK, num_blocks=2))  # a window >= the context:
    assert engine.pool.slide_window is None  # full attention, which the pool's prompt rule covers
    assert engine.submit([1, 2, 3], _greedy(9)).sequences[0].budget == 8 - 3
