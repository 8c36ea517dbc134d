"""Multi-head latent attention (trickles.models.mla): parity with transformers' DeepseekV3Attention, the absorbed
decode path against the uncompressed one, the latent cache's bytes per token, and the config's one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trickles.errors import ConfigError
from trickles.models.config import ModelConfig
from trickles.models.mla import LatentAttention
from trickles.models.rope import RopeScaling, rope_tables
from trickles.models.transformer import build_model

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0}
YARN_OURS = {"rope_type": "yarn", "rope_factor": 4.0, "rope_original_max_positions": 8, "rope_mscale": 1.0}
SHAPE = {"d_model": 48, "n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6}


def _configs(q_lora_rank: int | None, yarn: bool, mscale_all_dim: float = 0.8):
    rope = {"rope_theta": 10000.0, **(YARN | {"mscale_all_dim": mscale_all_dim} if yarn else {"rope_type": "default"})}
    theirs = hf.DeepseekV3Config(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        max_position_embeddings=32,
        rope_parameters=rope,
        rope_interleave=True,
        first_k_dense_replace=1,
        attn_implementation="eager",
    )
    ours = ModelConfig(
        **SHAPE,
        attention="mla",
        q_lora_rank=q_lora_rank,
        v_head_dim=10,
        rope_interleave=True,
        vocab_size=64,
        max_seq_len=32,
        **(YARN_OURS | {"rope_mscale_all_dim": mscale_all_dim} if yarn else {}),
    )
    ours.validate()
    return theirs, ours


@pytest.mark.parametrize("q_lora_rank, yarn", [(24, False), (None, False), (24, True)])
def test_latent_attention_matches_transformers(q_lora_rank, yarn):
    theirs, ours = _configs(q_lora_rank, yarn)
    torch.manual_seed(0)
    ref = hf.DeepseekV3Attention(theirs, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():  # norms perturbed away from one too
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    attn = LatentAttention(ours, 0).eval()
    attn.load_state_dict(ref.state_dict())  # same names: import is a copy
    t = 12
    x = torch.randn(2, t, 48) * 0.01  # small: the latent norms' epsilon (1e-6) matters
    cos, sin = hf.DeepseekV3RotaryEmbedding(theirs)(x, torch.arange(t)[None])
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = ref(x, (cos, sin), causal)
        got = attn(x, rope_tables(ours.rope_dim, t, ours.rope_theta, scaling=RopeScaling.of(ours)))
    if yarn:  # the yarn scale and mscale are in play, not 1
        assert ref.scaling != (8 + 6) ** -0.5 and attn.scale == pytest.approx(ref.scaling, rel=1e-12)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _model(q_lora_rank: int | None = 24, **extra) -> torch.nn.Module:
    cfg = ModelConfig(
        **SHAPE, attention="mla", q_lora_rank=q_lora_rank, v_head_dim=10, n_layers=2, vocab_size=64, max_seq_len=32
    )
    for key, value in extra.items():
        setattr(cfg, key, value)
    model = build_model(cfg, seed=3)
    with torch.no_grad():  # norms away from one, so a wrong norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("absorb_prefill", [False, True])
def test_absorbed_decode_equals_uncompressed_forward(absorb_prefill):
    model = _model(**YARN_OURS, rope_mscale_all_dim=0.8, rope_interleave=True)
    assert all(isinstance(b.attn, LatentAttention) for b in model.layers.values())
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        if absorb_prefill:  # the latent-space path for the prompt too
            for block in model.layers.values():
                block.attn.absorb_queries = 64
        cache = model.new_cache(2, 16)
        steps = [model(tokens[:, :5], cache=cache, start=0)]
        steps += [model(tokens[:, i : i + 1], cache=cache, start=i) for i in range(5, 11)]
    got = torch.cat(steps, dim=1)
    assert (got - full).abs().max() <= 1e-5 * full.abs().max()
    # left-padded rows (pad_mask, each row's positions): the decode step masks the padding as the prefill does
    pad = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    positions = (torch.arange(6)[None] - torch.tensor([[2], [0]])).clamp(min=0)
    with torch.no_grad():
        cache = model.new_cache(2, 8)
        model(tokens[:, :5], cache=cache, start=0, positions=positions[:, :5], pad_mask=pad[:, :5])
        step = model(tokens[:, 5:6], cache=cache, start=5, positions=positions[:, 5:], pad_mask=pad)
        alone = model(tokens[:1, 2:6])[:, -1:]  # the padded row without its padding
    assert (step[0] - alone[0]).abs().max() <= 1e-5 * alone.abs().max()
    assert (step[1] - full[1, 5:6]).abs().max() <= 1e-5 * full.abs().max()


def test_latent_cache_bytes_per_token_per_layer():
    model = _model(None).to(torch.bfloat16)
    cache = model.new_cache(3, 16)
    with torch.no_grad():
        model(torch.zeros(3, 4, dtype=torch.long), cache=cache, start=0)
    width = 16 + 6  # kv_lora_rank + qk_rope_head_dim
    assert cache.bytes_per_token == width * 2
    stored = sum(t.numel() * t.element_size() for t in (*cache.k.values(), *cache.v.values()))
    assert stored == width * 2 * 3 * 16 * 2  # bytes x rows x positions x layers: nothing else is kept
    # against multi-head attention of the same head count: keys and values of 4 heads of 14 and 10
    assert cache.bytes_per_token < 4 * (14 + 10) * 2 / 4


def test_mla_trains_and_packs_documents():
    model = _model().train()
    tokens = torch.randint(0, 64, (2, 9))
    loss = model(tokens[:, :-1], target=tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and model.layers["0"].attn.kv_b_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():  # packed documents: attention stays within each, positions restart
        model.eval()
        packed = model(tokens[:, :9], documents=torch.tensor([[0] * 4 + [1] * 5] * 2))
        apart = torch.cat([model(tokens[:, :4]), model(tokens[:, 4:9])], dim=1)
    assert (packed - apart).abs().max() <= 1e-5 * apart.abs().max()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"kv_lora_rank": 64}, r"model.kv_lora_rank \(64\) is above the width model.d_model \(48\)"),
        ({"q_lora_rank": 96}, r"model.q_lora_rank \(96\) is above the width"),
        ({"qk_rope_head_dim": 5}, r"model.qk_rope_head_dim \(5\) must be even"),
        ({"v_head_dim": 0}, r"model.v_head_dim must be at least 1"),
        ({"qk_norm": "head"}, r"model.qk_norm=head is not built with model.attention=mla"),
        ({"sliding_window": 4}, r"model.sliding_window=4 is not built with model.attention=mla; leave it unset"),
        ({"attention": "mqa"}, r"model.attention must be mha or mla, got 'mqa'"),
        ({"attention": "mha", "kv_lora_rank": 16}, r"model.q_lora_rank is read with model.attention=mla only"),
    ],
)
def test_mla_config_errors(fields, match):
    cfg = ModelConfig(**{**SHAPE, "attention": "mla", "q_lora_rank": 24, "v_head_dim": 10, **fields})
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_dense_deepseek_v3_imports_exports_and_generates_like_transformers(tmp_path):
    import json

    from trickles.models import load_hf, save_hf
    from trickles.models.generate import generate

    theirs, _ = _configs(24, True)
    theirs.num_hidden_layers = theirs.first_k_dense_replace = 2
    theirs.attention_bias = True
    theirs.bos_token_id, theirs.eos_token_id = 1, 2
    with torch.random.fork_rng():
        torch.manual_seed(5)
        ref = hf.DeepseekV3ForCausalLM(theirs).eval()
    g = torch.Generator().manual_seed(6)  # (its own generator: the model is the same whatever ran before)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    ref.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    assert (ours.cfg.attention, ours.cfg.q_lora_rank, ours.cfg.rope_interleave, ours.cfg.family) == (
        "mla",
        24,
        True,
        "deepseek_v3",
    )
    tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    prompt = tokens[:1]
    greedy = ref.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 8, temperature=0.0), greedy[:, prompt.shape[1] :])
    save_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens).logits, want)


@pytest.mark.parametrize(
    "layout, world, match",
    [(["parallel.tp=4", "parallel.tp_mode=2d"], 4, r"model.attention=mla does not combine with parallel.tp_mode")],
)
def test_layouts_not_built_for_mla_are_refused(layout, world, match):
    from trickles.config import Config

    shape = [f"model.{k}={v}" for k, v in {**SHAPE, "q_lora_rank": 24, "v_head_dim": 10}.items()]
    Config.load(None, ["model.attention=mla", *shape]).validate(1)
    with pytest.raises(ConfigError, match=match):
        Config.load(None, ["model.attention=mla", *shape, *layout]).validate(world)


def test_the_paged_engine_serves_from_latent_rows():
    """The continuous-batching engine over a paged pool of latent rows (``kv_lora_rank + qk_rope_head_dim`` values a
    position per layer, no keys and values): six greedy requests submitted between iterations, chunked prefill, a
    pool small enough to preempt, prefix caching on, each equal to plain decoding with the dense latent cache; a
    block holds exactly the rows' bytes, and a repeated prompt's full blocks are taken from the prefix cache."""
    import random

    from trickles.infer import Sampling, decode
    from trickles.infer.engine import Engine, EngineConfig
    from trickles.infer.paged import block_bytes

    cfg = ModelConfig(
        **SHAPE, attention="mla", q_lora_rank=24, v_head_dim=10, n_layers=2, ffn_hidden=64, vocab_size=260
    )
    cfg = dataclasses.replace(cfg, max_seq_len=96)
    cfg.validate()
    model = build_model(cfg, seed=3).eval()
    greedy = lambda n: Sampling(max_new_tokens=n, temperature=0)  # noqa: E731
    engine = Engine(model, None, EngineConfig(max_batch=4, block_size=4, num_blocks=14, prefill_chunk=5))
    rng = random.Random(7)
    jobs = [(rng.sample(range(256), k), n) for k, n in [(3, 30), (11, 12), (17, 25), (1, 40), (9, 7), (23, 20)]]
    requests = []
    for prompt, n in jobs:
        requests.append(engine.submit(prompt, greedy(n)))
        for _ in range(rng.randrange(3)):
            engine.step()
    engine.run_until_idle(max_steps=2000)
    assert any(s.preemptions for r in requests for s in r.sequences)
    assert [r.result[0].tokens for r in requests] == [decode(model, [p], greedy(n))[0].tokens for p, n in jobs]
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert block_bytes(model, 4) == 2 * 4 * rows * 4  # layers x positions x (L + r) x fp32
    assert engine.pool.bytes() == 14 * block_bytes(model, 4) and engine.pool.used == 0
    again = engine.submit(jobs[5][0], greedy(3))
    engine.run_until_idle(max_steps=200)
    assert again.sequences[0].cached >= 20  # (23 prompt tokens: five full blocks of 4 taken from the cache)
    assert again.result[0].tokens == decode(model, [jobs[5][0]], greedy(3))[0].tokens
