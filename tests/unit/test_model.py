"""The single-device transformer: shapes, deterministic layout-independent init, KV cache, sampling."""

import dataclasses

import pytest
import torch

from trickles.models import ModelConfig, apply_preset, build_model, count_params, initial_value
from trickles.models.generate import generate, sample_next
from trickles.train.flops import flops_per_token, matmul_params


def cfg_for(preset, **kw):
    c = apply_preset(ModelConfig(), preset)
    return dataclasses.replace(c, vocab_size=kw.pop("vocab_size", 128), max_seq_len=kw.pop("max_seq_len", 32), **kw)


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_forward_shape_and_param_names(preset):
    cfg = cfg_for(preset)
    m = build_model(cfg, seed=1)
    x = torch.randint(0, 128, (3, 17))
    assert m(x).shape == (3, 17, 128)
    names = {n for n, _ in m.named_parameters()}
    assert "layers.0.attn.q_proj.weight" in names and "layers.1.mlp.down_proj.weight" in names
    if preset == "tiny":
        assert "layers.0.mlp.gate_proj.weight" in names and not any(n.endswith("bias") for n in names)
        assert m.output.weight is not m.embed.weight
        assert m.layers["0"].attn.k_proj.weight.shape == (2 * 16, 64)  # 2 kv heads of 16
    else:
        assert "pos_embed.weight" in names and "layers.0.attn.q_proj.bias" in names
        assert m.output.weight is m.embed.weight


def test_init_is_deterministic_and_independent_of_build_order():
    cfg = cfg_for("tiny")
    a = build_model(cfg, seed=7)
    b = build_model(cfg, seed=7)
    c = build_model(cfg, seed=8)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if "norm" not in n:
            assert not torch.equal(p, r), n
    # a parameter's value depends only on (seed, name, shape): a shard can compute it alone
    w = a.layers["1"].mlp.up_proj.weight
    assert torch.equal(initial_value(cfg, "layers.1.mlp.up_proj.weight", tuple(w.shape), 7), w)
    std = a.layers["1"].attn.o_proj.weight.std().item()
    assert abs(std - 0.02 / (2 * cfg.n_layers) ** 0.5) < 0.003


def test_model_is_causal():
    m = build_model(cfg_for("tiny"), seed=0).eval()
    x = torch.randint(0, 128, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 128
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :8], m(y)[0, :8], atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_kv_cache_matches_full_forward(preset):
    m = build_model(cfg_for(preset), seed=0).eval()
    x = torch.randint(0, 128, (2, 20))
    cache = m.new_cache(2, 20)
    with torch.no_grad():
        full = m(x)
        parts = [m(x[:, :9], cache=cache, start=0), m(x[:, 9:15], cache=cache, start=9)]
        parts += [m(x[:, i : i + 1], cache=cache, start=i) for i in range(15, 20)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


def test_generate_greedy_equals_argmax_rollout_and_sampling_filters():
    m = build_model(cfg_for("tiny"), seed=3).eval()
    prompt = torch.randint(0, 128, (2, 5))
    out = generate(m, prompt, 6, temperature=0.0)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq[:, 5:])
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(50)} <= {2, 3}
    assert {sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(50)} == {2}
    # never longer than the model allows
    assert generate(m, prompt, 100, temperature=1.0).shape[1] == 32 - 5


def test_flops_formula_counts_matmul_parameters():
    cfg = cfg_for("tiny")
    total = count_params(build_model(cfg, 0))
    embed = cfg.vocab_size * cfg.d_model
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    assert matmul_params(cfg) == total - embed - norms
    assert flops_per_token(cfg, 32) == 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.d_model * 32


def test_meta_build_keeps_tied_weights():
    m = build_model(cfg_for("gpt2-tiny"), seed=0)
    assert m.output.weight is m.embed.weight
    assert count_params(m) == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_kv_cache_decoding_gives_the_full_forward_logits_at_every_position(preset):
    """Prefill then one token at a time through the cache: each step's logits are the full sequence's logits at that
    position (an off-by-one cache slot or position id shows here even where the argmax happens not to change)."""
    m = build_model(cfg_for(preset), seed=3).eval()
    seq = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        full = m(seq)
        cache = m.new_cache(2, 12)
        steps = [m(seq[:, :5], cache=cache, start=0)]
        for pos in range(5, 12):
            steps.append(m(seq[:, pos : pos + 1], cache=cache, start=pos))
    cached = torch.cat(steps, dim=1)
    assert cached.shape == full.shape
    assert torch.allclose(cached, full, rtol=0, atol=1e-5), (cached - full).abs().max()


def test_generate_scores_each_new_token_with_the_full_sequence_logits():
    """The logits ``generate`` samples every token from equal the full forward of prompt + tokens so far."""
    m = build_model(cfg_for("tiny"), seed=3).eval()
    prompt = torch.randint(0, 128, (2, 5))
    seen = []

    def record(z):
        seen.append(z[:, -1].clone())
        return z

    out = generate(m, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(0), logits_fn=record)
    with torch.no_grad():
        full = m(torch.cat([prompt, out], dim=1))
    assert len(seen) == 8
    for i, logits in enumerate(seen):  # token i of the continuation is drawn from the logits at position 4 + i
        assert torch.allclose(logits, full[:, 4 + i], rtol=0, atol=1e-5), (i, (logits - full[:, 4 + i]).abs().max())


def test_pipelined_model_switches_modes_like_a_module():
    """The stand-in ``generate`` sees for a pipeline stage: eval()/train() switch the stage's layers and return it,
    as nn.Module's do."""
    from trickles.parallel.pipeline.runner import PipelinedModel

    stage = build_model(cfg_for("tiny"), seed=0)
    wrapped = PipelinedModel(None, stage, stage.cfg.vocab_size)
    assert wrapped.eval() is wrapped and not wrapped.training and not stage.training
    assert wrapped.train() is wrapped and wrapped.training and stage.training
