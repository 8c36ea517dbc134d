"""Model families against transformers: Llama with attention and MLP biases, Qwen2, Mistral (no window: windows are
in tests/unit/test_windows.py), Qwen3
(per-head q/k norm) and OLMo 2 (full-width q/k norm, norms after attention and MLP).

Each tiny random model is built by transformers from its family's config class, its weights perturbed so that norms
and biases are not trivial, saved, imported with ``load_hf`` (fp32 logits within 1e-5 of transformers', relative to
the largest logit; greedy generation token-identical), exported with ``save_hf`` and reloaded by transformers as the
same class with equal logits. Also: a sharded directory, a bf16 one, the one-line refusals of each family.
"""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", exc_type=ImportError)

from safetensors.torch import load_file, save_file  # noqa: E402

from trickles.errors import CheckpointError, ConfigError  # noqa: E402
from trickles.models import ModelConfig, build_model, load_hf, save_hf  # noqa: E402
from trickles.models.generate import generate  # noqa: E402
from trickles.models.hf import load_hf as load_hf_as  # noqa: E402  (with fused_proj)
from trickles.models.hf_config import config_from_hf, config_to_hf  # noqa: E402

VOCAB, SEQ, NEW = 128, 12, 16
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama-biases": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True, rope_theta=5000.0)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=20000.0, use_sliding_window=False, sliding_window=4096)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, tie_word_embeddings=True)),
    # per-head q/k norm, an explicit head_dim that is not hidden / heads, attention_bias on
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, attention_bias=True, rope_theta=30000.0)),
    # full-width q/k norm, norms after attention and the MLP only
    "olmo2": (transformers.Olmo2Config, dict(rope_theta=40000.0)),
}
CLASSES = {
    "llama-biases": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}
# the trickles fields each family's import must set
FIELDS = {
    "llama-biases": dict(family="llama", qkv_bias=True, o_bias=True, mlp_bias=True, rope_theta=5000.0),
    "qwen2": dict(family="qwen2", qkv_bias=True, o_bias=False, mlp_bias=False, rope_theta=20000.0),
    "mistral": dict(family="mistral", qkv_bias=None, o_bias=None, mlp_bias=None, tie_embeddings=True),
    "qwen3": dict(family="qwen3", qkv_bias=True, o_bias=True, mlp_bias=False, qk_norm="head", head_size=24),
    "olmo2": dict(family="olmo2", qkv_bias=False, qk_norm="full", norm_placement="post", rope_theta=40000.0),
}

_MODELS = {}


def hf_model(name):
    """The family's perturbed transformers model (built once per run)."""
    if name not in _MODELS:
        config_class, extra = FAMILIES[name]
        # transformers initializes from the global generator: seeded, so a run cannot draw a model whose greedy
        # choice is the end-of-sequence token transformers' min_new_tokens suppresses
        with torch.random.fork_rng():
            torch.manual_seed(17 + list(FAMILIES).index(name))
            model = transformers.AutoModelForCausalLM.from_config(
                config_class(**SHAPE, **extra), attn_implementation="sdpa"
            )
        g = torch.Generator().manual_seed(list(FAMILIES).index(name))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        _MODELS[name] = model.eval()
    return _MODELS[name]


def tokens():
    return torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def hf_logits(model):
    return model(tokens()).logits


@torch.no_grad()
def our_logits(model):
    return model.eval()(tokens()).float()


def assert_close(ours, theirs, rel=1e-5):
    assert ours.shape == theirs.shape
    err = (ours - theirs).abs().max().item() / theirs.abs().max().item()
    assert err <= rel, err


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_export_and_generate_like_transformers(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_hf(tmp_path / "hf")
    for key, value in FIELDS[name].items():
        assert getattr(ours.cfg, key) == value, key
    expected = hf_logits(hf)
    assert_close(our_logits(ours), expected)

    prompt = tokens()[:1]
    theirs = hf.generate(prompt, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, NEW, temperature=0.0), theirs[:, prompt.shape[1] :])

    save_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [CLASSES[name]]
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="sdpa"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == CLASSES[name]
    assert torch.equal(hf_logits(back.eval()), hf_logits(hf))
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(
        load_file(tmp_path / "hf" / "model.safetensors")
    )


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_sharded_bf16_and_fused_qwen2(fused, tmp_path):
    """A sharded directory with an index, read into fused projections (whose biases are interleaved like the
    weights); a bf16 directory within bf16's tolerance."""
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ours = load_hf_as(tmp_path / "sharded", fused_proj=fused)
    assert hasattr(ours.layers["0"].attn, "qkv_proj") == fused
    assert_close(our_logits(ours), hf_logits(hf))
    save_hf(ours, tmp_path / "out")
    assert torch.equal(hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")), hf_logits(hf))
    if not fused:
        copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
        half = load_hf(tmp_path / "bf16", dtype="bfloat16")
        assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
        assert_close(our_logits(half), hf_logits(hf), rel=3e-2)


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])
def test_qk_normed_families_fused_and_bf16(name, tmp_path):
    """q/k norms after fused projections (a view of the heads), and a bf16 directory within bf16's tolerance."""
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "fp32")
    assert_close(our_logits(load_hf_as(tmp_path / "fp32", fused_proj=True)), hf_logits(hf))
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert_close(our_logits(load_hf(tmp_path / "bf16", dtype="bfloat16")), hf_logits(hf), rel=3e-2)


@pytest.mark.parametrize(
    "shape, model_type",
    [
        (dict(qkv_bias=True, o_bias=True, mlp_bias=True), "llama"),
        (dict(qkv_bias=True), "qwen2"),
        (dict(), "llama"),
        (dict(family="mistral"), "mistral"),
        (dict(qk_norm="head"), "qwen3"),
        (dict(qk_norm="full", norm_placement="post", qkv_bias=True, o_bias=True), "olmo2"),
    ],
    ids=["all-biases", "qkv-bias", "plain", "mistral", "qwen3", "olmo2"],
)
def test_trickles_models_export_as_their_family(shape, model_type, tmp_path):
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32, **shape)
    ours = build_model(cfg, seed=3)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_hf(ours, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == model_type
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert_close(hf_logits(hf), our_logits(ours))
    again = load_hf(tmp_path / "m")
    assert [again.cfg.bias(p) for p in ("qkv", "o", "mlp")] == [cfg.bias(p) for p in ("qkv", "o", "mlp")]
    assert (again.cfg.qk_norm, again.cfg.norm_placement) == (cfg.qk_norm, cfg.norm_placement)


def _config(name, **changes):
    config_class, extra = FAMILIES[name]
    return {**config_class(**SHAPE, **extra).to_dict(), **changes}


@pytest.mark.parametrize(
    "name, changes, message",
    [
        (
            "llama-biases",
            dict(model_type="gptj"),
            "model_type 'gptj' is not supported; load_hf reads 'deepseek_v3'.*'gemma2'.*'gpt2'.*'phi3'",
        ),
        ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types names sliding_attention"),
        ("qwen3", dict(use_sliding_window=True, layer_types=["local"] * 2), "only sliding_attention and full_att"),
    ],
)
def test_family_configs_refused_in_one_line(name, changes, message):
    with pytest.raises(CheckpointError, match=message) as e:
        config_from_hf(_config(name, **changes), "config.json")
    assert "\n" not in str(e.value)


def test_windows_that_never_cut_are_full_attention():
    """Qwen2's window is ignored while use_sliding_window is false (max_window_layers too); a Mistral window as long
    as the context never cuts, and is written back; Qwen3 takes its windows as Qwen2 does (more: test_windows.py)."""
    qwen = config_from_hf(_config("qwen2", sliding_window=8, max_window_layers=1), "config.json")
    mistral = config_from_hf(_config("mistral", sliding_window=64), "config.json")
    assert qwen.family == "qwen2" and qwen.sliding_window is None and mistral.family == "mistral"
    assert config_to_hf(mistral, torch.float32)["sliding_window"] == 64
    windowed = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    qwen3 = config_from_hf(_config("qwen3", **windowed), "config.json")
    assert (qwen3.sliding_window, qwen3.window_layers) == (8, [False, True])
    assert config_to_hf(qwen3, torch.float32)["layer_types"] == ["full_attention", "sliding_attention"]


@pytest.mark.parametrize(
    "shape, message",
    [
        (dict(family="qwen2"), "Qwen2 has a bias on its qkv projections, but model.qkv_bias=false"),
        (dict(family="mistral", mlp_bias=True), "Mistral has no bias on its mlp projections"),
        (dict(family="llama", qkv_bias=True), "attention_bias puts a bias on q, k, v and o alike"),
        (dict(qkv_bias=True, mlp_bias=True), "no Hugging Face family writes this model"),
        (dict(family="gemma"), "model.family='gemma' is not a known family"),
        (dict(family="llama", qk_norm="head"), "LlamaForCausalLM has model.qk_norm=none, but this model has head"),
        (dict(norm_placement="sandwich"), "has model.norm_placement=pre, but this model has sandwich"),
        (dict(qk_norm="head", norm_placement="post"), "Qwen2ForCausalLM has model.qk_norm=none|LlamaForCausalLM has"),
        (
            dict(family="olmo2", qk_norm="full"),
            "Olmo2ForCausalLM has model.norm_placement=post, but this model has pre",
        ),
    ],
)
def test_unexportable_bias_and_norm_layouts(shape, message):
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16, **shape)
    with pytest.raises(ConfigError, match=message):
        config_to_hf(cfg, torch.float32)


@pytest.mark.parametrize("edit", ["missing", "extra"])
def test_bias_tensors_must_match_the_config(edit, tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    if edit == "missing":
        del weights["model.layers.1.self_attn.v_proj.bias"]
        message = r"missing tensors \['model\.layers\.1\.self_attn\.v_proj\.bias'\], unexpected tensors \[\]"
    else:
        weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
        message = r"missing tensors \[\], unexpected tensors \['model\.layers\.0\.self_attn\.o_proj\.bias'\]"
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message) as e:
        load_hf(tmp_path)
    assert "\n" not in str(e.value)
