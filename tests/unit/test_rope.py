"""Rotary scaling (``model.rope_type``): tables and logits equal to transformers' for every type, the Hugging Face
fields both ways, and bad settings refused in one line."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers", exc_type=ImportError)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from trickles.config import Config, describe_keys  # noqa: E402
from trickles.errors import CheckpointError, ConfigError  # noqa: E402
from trickles.models import ModelConfig, build_model  # noqa: E402
from trickles.models.rope import RopeScaling, rope_fields_from_hf, rope_fields_to_hf  # noqa: E402
from trickles.models.transformer import rope_tables  # noqa: E402

MAX_POS, ORIGINAL, VOCAB = 128, 32, 97  # positions 0..127 run well past the original context
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    # DeepSeek-style mscale ratio, another band, an unrounded ramp (its ends fall between dimensions)
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 4,
        "beta_slow": 0.25,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "truncate": False,
    },
    "yarn-attention": {"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.25},  # original: max_position
}


def hf_config(scaling, **extra) -> "transformers.LlamaConfig":
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    return transformers.LlamaConfig(**{**shape, "rope_theta": 5000.0, "rope_scaling": scaling, **extra})


def ours(fields: dict, **extra) -> ModelConfig:
    return ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=MAX_POS, **fields, **extra)


def hf_tables(config) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(MAX_POS)[None])
    return cos[0], sin[0]


def our_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_tables(cfg.head_dim, MAX_POS, cfg.rope_theta, scaling=RopeScaling.of(cfg))


def assert_tables_equal(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", SCALINGS)
def test_tables_match_transformers_and_round_trip(name):
    config = hf_config(SCALINGS[name])
    fields = rope_fields_from_hf(config.to_dict(), "config.json")
    cfg = ours(fields)
    cfg.validate()
    assert cfg.rope_type == (SCALINGS[name] or {}).get("rope_type", "default")
    assert_tables_equal(our_tables(cfg), hf_tables(config))
    if name != "default":  # the scaling is there to be seen: not the default tables
        assert not torch.allclose(our_tables(cfg)[1], our_tables(ours({"rope_theta": 5000.0}))[1], atol=1e-3)

    written = rope_fields_to_hf(cfg)
    assert rope_fields_from_hf(written, "again") == fields
    # what 4.x reads (rope_theta + rope_scaling) and what 5.x writes (rope_parameters) each build the same rotary
    shape = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POS
    )
    assert_tables_equal(hf_tables(transformers.LlamaConfig(**shape, **written)), hf_tables(config))
    v4 = {"rope_theta": written["rope_theta"], "rope_scaling": written["rope_scaling"]}
    assert_tables_equal(hf_tables(transformers.LlamaConfig(**shape, **v4)), hf_tables(config))
    v5 = transformers.LlamaConfig(**shape, rope_parameters=dict(written["rope_parameters"]))
    assert_tables_equal(hf_tables(v5), hf_tables(config))


def _hf_to_ours(name: str) -> str:
    for a, b in (("model.embed_tokens", "embed"), ("model.layers", "layers"), ("model.norm", "norm")):
        name = name.replace(a, b)
    for a, b in (("self_attn", "attn"), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")):
        name = name.replace(a, b)
    return name.replace("lm_head", "output")


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn"])
@torch.no_grad()
def test_logits_match_transformers_past_the_original_context(name):
    config = hf_config(SCALINGS[name], vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    for p in theirs.parameters():  # norms start at one: move every weight
        p.add_(torch.randn(p.shape, generator=g) * 0.1)

    fields = rope_fields_from_hf(config.to_dict(), "config.json")
    cfg = ours(fields, n_layers=2, ffn_hidden=96, vocab_size=VOCAB, norm_eps=1e-5, fused_proj=False, kernels="torch")
    model = build_model(cfg, seed=0).eval()
    model.load_state_dict({_hf_to_ours(k): v for k, v in theirs.state_dict().items()})

    tokens = torch.randint(0, VOCAB, (2, 96), generator=g)
    want, got = theirs(tokens).logits, model(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


@pytest.mark.parametrize(
    "scaling,message",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic' is not supported (its frequencies change"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "rope_type='longrope' is not supported (its per-dimension"),
        ({"rope_type": "su"}, "rope_type='su' is not supported; trickles builds default, linear, llama3, yarn"),
        ({"rope_type": "linear"}, "rope_scaling.factor is missing; rope_type='linear' needs it"),
        ({"rope_type": "linear", "factor": 0.0}, "model.rope_factor must be greater than 0, got 0.0"),
        ({"type": "linear", "factor": "2"}, "rope_scaling.factor='2' must be a number"),
        (
            {**SCALINGS["llama3"], "low_freq_factor": 4.0},
            "model.rope_high_freq_factor (4.0) must be greater than rope_low_freq_factor (4.0)",
        ),
        ({**SCALINGS["llama3"], "original_max_position_embeddings": 8.5}, "original_max_position_embeddings=8.5 must"),
        (
            {**SCALINGS["yarn"], "beta_fast": 1, "beta_slow": 4},
            "yarn needs model.rope_beta_fast (1.0) >= rope_beta_slow",
        ),
        ({**SCALINGS["yarn"], "truncate": "yes"}, "rope_scaling.truncate='yes' must be true or false"),
        ({**SCALINGS["linear"], "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        ({"full_attention": {"rope_type": "default"}}, "is not one flat dict"),
        ({"rope_type": "default", "rope_theta": 7.0}, "rope_theta=5000.0 disagrees with rope_scaling.rope_theta=7.0"),
    ],
)
def test_hugging_face_fields_refused_in_one_line(scaling, message):
    raw = {"model_type": "llama", "max_position_embeddings": MAX_POS, "rope_theta": 5000.0, "rope_scaling": scaling}
    with pytest.raises(CheckpointError) as e:
        rope_fields_from_hf(raw, "dir/config.json")
    text = str(e.value)
    assert message in text and text.startswith("dir/config.json: ") and "\n" not in text, text


def test_hugging_face_defaults():
    """What transformers fills in: the original context from max_position_embeddings, yarn's factor as their ratio,
    beta 0 as the default, the base of the model type, 4.x's ``type``."""
    raw = {
        "max_position_embeddings": 96,
        "rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 32},
    }
    fields = rope_fields_from_hf(raw, "c", default_theta=1e6)
    assert (fields["rope_factor"], fields["rope_theta"], fields["rope_beta_fast"]) == (3.0, 1e6, 32.0)
    raw = {"max_position_embeddings": 96, "rope_scaling": {**SCALINGS["llama3"], "beta_fast": 0}}
    del raw["rope_scaling"]["original_max_position_embeddings"]
    assert rope_fields_from_hf(raw, "c")["rope_original_max_positions"] == 96
    assert rope_fields_from_hf({"rope_scaling": {"type": "linear", "factor": 2}}, "c")["rope_factor"] == 2.0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.rope_type=dynamic"], "model.rope_type must be one of 'default', 'linear', 'llama3', 'yarn'"),
        (["model.rope_type=linear", "model.rope_factor=0"], "model.rope_factor must be greater than 0, got 0.0"),
        (["model.rope_type=yarn", "model.rope_factor=-2"], "model.rope_factor must be greater than 0, got -2.0"),
        (["model.rope_type=linear", "model.rope_beta_fast=8"], "model.rope_beta_fast has no effect with model.rope"),
        (["model.rope_factor=8"], "model.rope_factor has no effect with model.rope_type=default; leave it unset"),
        (
            ["model.rope_type=llama3", "model.rope_low_freq_factor=4"],
            "model.rope_high_freq_factor (4.0) must be greater than rope_low_freq_factor (4.0)",
        ),
        (["model.rope_type=llama3", "model.rope_original_max_positions=0"], "model.rope_original_max_positions must"),
        (["model.rope_type=yarn", "model.rope_attention_factor=0"], "model.rope_attention_factor must be greater"),
        (["model.rope_theta=0"], "model.rope_theta must be greater than 0, got 0.0"),
        (["model.preset=gpt2-tiny", "model.rope_type=linear"], "model.rope_type=linear needs rotary embeddings"),
    ],
)
def test_bad_rope_settings_refused_at_load(overrides, message):
    with pytest.raises(ConfigError) as e:
        Config.load(None, overrides).validate(1)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_fields_are_documented_keys_with_one_set_of_defaults():
    keys = describe_keys()
    defaults = ModelConfig()
    for f in dataclasses.fields(RopeScaling):
        assert f"model.rope_{f.name}" in keys
        assert getattr(defaults, f"rope_{f.name}") == f.default, f.name
    # a scaled model carries its scaling into the tables every layout indexes
    cfg = ours(rope_fields_from_hf({"rope_scaling": SCALINGS["yarn"]}, "c"), n_layers=1, vocab_size=VOCAB)
    model = build_model(cfg, seed=0)
    assert_tables_equal(model.rope(0, MAX_POS), our_tables(cfg))


def test_tables_fill_lazily_and_equal_the_whole_computation():
    """The model's tables are filled on first read up to what is read (at least doubling), and every row equals the
    one-shot computation; an earlier graph's views of filled rows see no version change when later rows fill."""
    cfg = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=20000, n_layers=1, vocab_size=VOCAB)
    model = build_model(cfg, seed=0)
    assert model._rope_rows == 0  # nothing computed at build
    cos, sin = model.rope(0, 16)
    assert model._rope_rows == 4096
    version = cos._version
    later = model.rope(5000, 10)  # fills 4096..8192 at least
    assert model._rope_rows == 8192 and cos._version == version
    whole = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    assert torch.equal(later[0], whole[0][5000:5010]) and torch.equal(cos, whole[0][:16])
    model.rope(0, 1, torch.tensor([[19999]]))  # rows named by a tensor: all of them
    assert model._rope_rows == 20000 and torch.equal(model.rope_sin, whole[1])
