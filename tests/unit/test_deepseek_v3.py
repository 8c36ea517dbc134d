"""DeepSeek-V3 with its DeepSeekMoE blocks against transformers: a tiny random ``DeepseekV3ForCausalLM`` (latent
attention, a dense first block, group-limited sigmoid routing over fine-grained and shared experts), its weights and
routing biases perturbed, imported with ``load_hf`` (fp32 logits within 1e-5 of transformers', relative to the largest
logit; greedy generation token-identical) and exported back (the same class, equal logits, the same tensors, the bias
in fp32); the one-line refusals of what the routing cannot express, on import and export."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", exc_type=ImportError)

from safetensors.torch import load_file  # noqa: E402

from trickles.errors import CheckpointError, ConfigError  # noqa: E402
from trickles.models import load_hf, save_hf  # noqa: E402
from trickles.models.generate import generate  # noqa: E402
from trickles.models.hf_config import config_from_hf, config_to_hf  # noqa: E402

VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    max_position_embeddings=64,
    rope_interleave=True,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    # DeepSeekMoE: block 0 dense, blocks 1 and 2 of 16 experts in 4 groups, 2 groups and 3 experts a token
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=16,
    n_shared_experts=2,
    routed_scaling_factor=1.7,
    norm_topk_prob=True,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The perturbed transformers model and its saved directory."""
    with torch.random.fork_rng():
        torch.manual_seed(7)
        ref = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(**SHAPE, attn_implementation="eager")
        ).eval()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    path = tmp_path_factory.mktemp("deepseek") / "hf"
    ref.save_pretrained(path)
    return ref, path


def _tokens():
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def test_deepseek_v3_moe_imports_exports_and_generates_like_transformers(reference, tmp_path):
    ref, path = reference
    ours = load_hf(path).eval()
    cfg = ours.cfg
    assert (cfg.family, cfg.attention, cfg.moe_layers, cfg.moe_first_dense) == ("deepseek_v3", "mla", [1, 2], 1)
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_groups, cfg.moe_topk_groups) == (16, 3, 4, 2)
    assert (cfg.moe_router_score, cfg.moe_routed_scale, cfg.moe_norm_topk, cfg.moe_shared_experts) == (
        "sigmoid",
        1.7,
        True,
        2,
    )
    theirs_bias = ref.model.layers[2].mlp.gate.e_score_correction_bias
    bias = ours.layers["2"].mlp.router.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, theirs_bias) and bias.abs().max() > 0
    tokens = _tokens()
    with torch.no_grad():
        want, got = ref(tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    prompt = tokens[:1]
    greedy = ref.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 8, temperature=0.0), greedy[:, prompt.shape[1] :])

    save_hf(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV3ForCausalLM"] and written["first_k_dense_replace"] == 1
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back) is type(ref)
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens).logits, want)
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(load_file(path / "model.safetensors"))

    save_hf(ours, tmp_path / "bf16", dtype=torch.bfloat16)  # the bias keeps fp32, as transformers holds it
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert load_hf(tmp_path / "bf16", dtype=torch.bfloat16).layers["1"].mlp.router.e_score_correction_bias.dtype == (
        torch.float32
    )


def _raw(**changes):
    raw = {**SHAPE, "model_type": "deepseek_v3", **changes}
    return {k: v for k, v in raw.items() if v is not None}


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(topk_method="greedy"), r"topk_method='greedy' \(only topk_method='noaux_tc'"),
        (dict(scoring_func="softmax"), r"scoring_func='softmax' \(only scoring_func='sigmoid'"),
        (dict(moe_layer_freq=2), r"moe_layer_freq=2 \(only moe_layer_freq=1"),
        (dict(n_shared_experts=0), r"n_shared_experts=0"),
        (dict(n_group=3), r"model.moe_groups \(3\) must divide model.moe_experts \(16\) into equal groups"),
        (dict(topk_group=5), r"model.moe_topk_groups must be between 1 and model.moe_groups \(4\), got 5"),
        (dict(kv_lora_rank=64), r"model.kv_lora_rank \(64\) is above the width model.d_model \(48\)"),
    ],
)
def test_deepseek_v3_routing_refused_in_one_line(changes, message):
    with pytest.raises(CheckpointError, match=message) as err:
        config_from_hf(_raw(**changes), "config.json")
    assert "\n" not in str(err.value)


def test_deepseek_v3_config_round_trip_and_export_refusals():
    cfg = config_from_hf(_raw(), "config.json")
    assert config_from_hf(config_to_hf(cfg, torch.float32), "out") == cfg
    dense = config_from_hf(_raw(first_k_dense_replace=3), "config.json")
    assert dense.moe_experts == 0 and config_to_hf(dense, torch.float32)["first_k_dense_replace"] == 3
    for key, value in (("moe_router_score", "softmax"), ("moe_every", 2), ("moe_capacity_factor", 1.0)):
        changed = cfg.__class__(**{**cfg.__dict__, key: value})
        with pytest.raises(ConfigError, match=rf"DeepSeek-V3 has no model.{key}={value}; set model.{key}="):
            config_to_hf(changed, torch.float32)


def test_first_dense_blocks_combine_with_moe_every():
    from trickles.models.config import ModelConfig
    from trickles.models.moe import MoE
    from trickles.models.transformer import Transformer

    cfg = ModelConfig(n_layers=6, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16, moe_experts=4)
    assert ModelConfig(**{**cfg.__dict__, "moe_first_dense": 3}).moe_layers == [3, 4, 5]
    cfg = ModelConfig(**{**cfg.__dict__, "moe_first_dense": 2, "moe_every": 2})
    cfg.validate()
    assert cfg.moe_layers == [3, 5]
    with torch.device("meta"):
        model = Transformer(cfg)
    assert [isinstance(model.layers[str(i)].mlp, MoE) for i in range(6)] == [False, False, False, True, False, True]
    with pytest.raises(ConfigError, match=r"model.moe_first_dense \(6\) must be from 0 to model.n_layers - 1 \(5\)"):
        ModelConfig(**{**cfg.__dict__, "moe_first_dense": 6}).validate()
