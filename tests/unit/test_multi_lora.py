"""Many LoRA adapters in one batch (trickles.adapters.multi): each row's update from its own slot equals that adapter
merged into the weights and run alone, fused projections included; the engine admits, waits for and evicts slots
(``max_loras``), and prefix-cache keys start from the adapter, so no adapter reads another's cached blocks."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from trickles.adapters.multi import AdapterBank
from trickles.errors import ConfigError
from trickles.infer.decode import Sampling
from trickles.infer.engine import Engine, EngineConfig
from trickles.models import ModelConfig, build_model
from trickles.models.fused import fuse_state, split_state

PROMPTS = [list(range(1, 20)), [5, 6, 7], [9, 9, 9, 9], list(range(1, 21)), [3, 1, 4, 1, 5]]
CHOICE = ["a", None, "b", "a", "b"]


def _cfg(fused: bool) -> ModelConfig:
    return ModelConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=64, fused_proj=fused
    )


def _adapter(name: str, rank: int, targets: tuple[str, ...], seed: int):
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for n, m in build_model(_cfg(False), seed=0).named_modules():
        if type(m) is nn.Linear and n.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, m.in_features, generator=g) * 0.3
            weights[n] = (a, torch.randn(m.out_features, rank, generator=g) * 0.3)
    return types.SimpleNamespace(name=name, weights=weights, path=f"/adapters/{name}")


ADAPTERS = {
    "a": _adapter("a", 4, ("q_proj", "v_proj", "down_proj"), 1),
    "b": _adapter("b", 2, ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"), 2),
}


def _merged(model, adapter):
    """``model`` with ``adapter``'s ``B A`` added to its weights (None: the base)."""
    out = copy.deepcopy(model)
    state = split_state(out.cfg, {k: v.clone() for k, v in out.state_dict().items()})
    for name, (a, b) in (adapter.weights if adapter else {}).items():
        state[name + ".weight"] += b @ a
    out.load_state_dict(fuse_state(out.cfg, state))
    return out


def _tokens(model, prompts, choice, bank=None, **config):
    config = {"max_batch": 8, "block_size": 4, "num_blocks": 64, **config}
    engine = Engine(model, None, EngineConfig(adapters=bank, **config))
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    requests = [engine.submit(p, greedy, adapter=c) for p, c in zip(prompts, choice)]
    engine.run_until_idle()
    return [r.result[0].tokens for r in requests], engine


@pytest.mark.parametrize("fused", [False, True])
def test_a_mixed_batch_equals_each_adapter_merged_alone(fused):
    base = build_model(_cfg(fused), seed=0).eval()
    model = copy.deepcopy(base)
    bank = AdapterBank(model, list(ADAPTERS.values()), max_loras=2)
    assert sorted(bank.targets) == sorted(
        {n.rsplit(".", 1)[0] for n, p in model.named_parameters() if "proj" in n and "norm" not in n}
    )
    x = torch.randint(0, 64, (3, 10))
    bank.select([bank.acquire("a"), None, bank.acquire("b")])  # rows of a, the base, b
    with torch.no_grad():
        mixed = model(x)
        alone = [_merged(base, ADAPTERS[c] if c else None)(x[i : i + 1])[0] for i, c in enumerate(["a", None, "b"])]
        bank.select([bank.slot_of["b"]] * 3)  # one group of every row: updated in place
        every = model(x)
        want_b = _merged(base, ADAPTERS["b"])(x)
    for got, want in zip(mixed, alone):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(every, want_b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1], atol=1e-3) and not torch.allclose(alone[2], alone[1], atol=1e-3)

    # through the engine, one slot: a request for another adapter waits until no running sequence holds it
    model = copy.deepcopy(base)
    bank = AdapterBank(model, list(ADAPTERS.values()), max_loras=1)
    got, _ = _tokens(model, PROMPTS, CHOICE, bank)
    want = [_tokens(_merged(base, ADAPTERS[c] if c else None), [p], [None])[0][0] for p, c in zip(PROMPTS, CHOICE)]
    assert got == want
    assert bank.loads >= 3 and bank.holds == [0]  # a, then b, then a again; nothing held once idle


def test_prefix_cache_blocks_are_shared_within_an_adapter_only():
    base = build_model(_cfg(False), seed=0).eval()
    model = copy.deepcopy(base)
    bank = AdapterBank(model, list(ADAPTERS.values()), max_loras=2)
    prompt = list(range(1, 18))  # four full blocks of 4 before its last token
    got, engine = _tokens(model, [prompt] * 4, ["a", None, "a", "b"], bank, max_batch=1)
    want = [_tokens(_merged(base, ADAPTERS[c] if c else None), [prompt], [None])[0][0] for c in ["a", None, "a", "b"]]
    assert got == want
    assert engine.pool.blocks.hits == 16  # only the second request of adapter a reused the first one's blocks


def test_bad_adapters_are_refused():
    base = build_model(_cfg(False), seed=0).eval()
    bank = AdapterBank(copy.deepcopy(base), [ADAPTERS["a"]], max_loras=1)
    engine = Engine(base, None, EngineConfig(block_size=4, num_blocks=16, adapters=bank))
    with pytest.raises(ValueError, match="no adapter 'zz' is served here; choose one of \\['a'\\]"):
        engine.submit([1, 2], Sampling(max_new_tokens=2), adapter="zz")
    wrong = {"layers.0.attn.q_proj": (torch.zeros(2, 16), torch.zeros(32, 2))}
    with pytest.raises(ConfigError, match="adapter 'w': layers.0.attn.q_proj has A \\[2, 16\\].*another model"):
        AdapterBank(copy.deepcopy(base), [types.SimpleNamespace(name="w", weights=wrong)], 1)
    missing = {"layers.7.attn.q_proj": (torch.zeros(2, 32), torch.zeros(32, 2))}
    with pytest.raises(ConfigError, match="updates layers.7.attn.q_proj, which is no linear"):
        AdapterBank(copy.deepcopy(base), [types.SimpleNamespace(name="m", weights=missing)], 1)
    with pytest.raises(ConfigError, match="names must differ"):
        AdapterBank(copy.deepcopy(base), [ADAPTERS["a"], ADAPTERS["a"]], 1)
