"""Batched decoding (trickles.infer) and the serving engine through a tensor-parallel model (the vocabulary shards
gathered by the engine's ``full_logits``) and through a mixture-of-experts model with its experts split over two ranks
(every token sent to its experts' rank and back): prompts of different lengths, left-padded, decode as one process
does."""

import math

import pytest
import torch
from helpers import tiny_config

from trickles.infer import PaddedBatch, Sampling, beam_search, decode
from trickles.infer.engine import Engine, EngineConfig
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 99], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [200, 100, 50, 25, 12, 6]]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"data.cache_dir={tmp_path_factory.mktemp('infer-tp-cache')}"


MOE = ["model.moe_experts=4", "model.moe_every=2"]


def _world(dims):
    return math.prod(v for k, v in dims.items() if k != "ep")  # experts spread over the dp ranks, adding none


def _decode(tmp, dims, cache, extra=()):
    cfg = tiny_config(tmp, cache, *(f"parallel.{k}={v}" for k, v in dims.items()), *extra, steps=2)
    tr = Trainer(cfg, cfg.validate(_world(dims)).build(CPU), quiet=True)
    tr.train_step()
    tr.train_step()
    model, full = tr.model, tr.engine.full_logits
    model.eval()
    with torch.no_grad():
        batch = PaddedBatch(model, PROMPTS, 4, logits_fn=full)
        logits = [batch.prefill()]
        for _ in range(3):
            logits.append(batch.step(logits[-1].argmax(-1)))
    greedy = decode(model, PROMPTS, Sampling(max_new_tokens=10, temperature=0), logits_fn=full)
    sampled = decode(model, PROMPTS, Sampling(max_new_tokens=10, temperature=1.0, seed=3), logits_fn=full)
    beams = beam_search(model, PROMPTS, 3, 8, logits_fn=full)
    # the serving engine: every rank submits the same requests between the same iterations, so all schedule alike
    engine = Engine(model, None, EngineConfig(max_batch=2, block_size=4, num_blocks=8, prefill_chunk=6), logits_fn=full)
    served = [engine.submit(p, Sampling(max_new_tokens=10, temperature=t, seed=3)) for p in PROMPTS for t in (0.0, 1.0)]
    engine.run_until_idle()
    served = [r.result[0].tokens for r in served]
    assert served[::2] == [c.tokens for c in greedy] and served[1::2] == [c.tokens for c in sampled]
    return (
        [x.clone() for x in logits],
        [c.tokens for c in greedy],
        [c.tokens for c in sampled],
        [c.tokens for c in beams],
        served,
    )


@pytest.mark.parametrize("dims,extra", [({"tp": 2}, []), ({"dp": 2, "ep": 2}, MOE)], ids=["tp2", "moe-ep2"])
def test_parallel_decoding_matches_one_process(tmp_path, cache, dims, extra):
    [ref] = run_ranks(1, _decode, str(tmp_path / "one"), {}, cache, extra)
    for rank in run_ranks(_world(dims), _decode, str(tmp_path / "par"), dims, cache, extra):
        for a, b in zip(rank[0], ref[0]):
            # whole-vocabulary logits at every step; measured gap 9e-7 (fp32 sums split over the two ranks)
            assert a.shape == b.shape and (a - b).abs().max() <= 1e-5
        assert rank[1:] == ref[1:]
