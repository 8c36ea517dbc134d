"""Phi-3, Gemma 2 and Gemma 3 (text) against transformers, in the style of tests/unit/test_families.py.

Each tiny random model is built by transformers from its family's config class with every feature on (Phi-3: a
sliding window on every layer, dropout fields set, fused ``qkv_proj`` / ``gate_up_proj`` tensors; Gemma 2: attention
and final soft-capping, ``query_pre_attn_scalar``, alternating local/global layers, attention biases, ``head_dim``
not ``hidden / heads``; Gemma 3: per-head q/k norms, a rotary base of its own for the sliding layers and linear
scaling on the full ones), its weights perturbed so that the ``(1 + w)`` norms and biases are not trivial, and
saved once. Sequences are longer than the window. Checked: fp32 logits within 1e-5 of transformers' (relative to the
largest logit); greedy generation token-identical; the export reloads as the same class with equal logits and the
same tensor names; projections fused on import; bf16 within bf16's tolerance; the window taken as written; the
one-line refusals.
"""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", exc_type=ImportError)

from safetensors.torch import load_file  # noqa: E402

from trickles.errors import CheckpointError, ConfigError  # noqa: E402
from trickles.models import ModelConfig, build_model, load_hf, save_hf  # noqa: E402
from trickles.models.generate import generate  # noqa: E402
from trickles.models.hf import load_hf as load_hf_as  # noqa: E402  (with fused_proj)
from trickles.models.hf_config import config_from_hf, config_to_hf  # noqa: E402

VOCAB, SEQ, PROMPT, NEW, WINDOW = 128, 40, 12, 24, 8
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    sliding_window=WINDOW,
)
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA = dict(head_dim=24, query_pre_attn_scalar=20, attention_bias=True, layer_types=TYPES)
FAMILIES = {
    "phi3": (transformers.Phi3Config, dict(rope_theta=30000.0, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1)),
    "gemma2": (
        transformers.Gemma2Config,
        dict(GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=5.0, rope_theta=20000.0),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            GEMMA,
            final_logit_softcapping=5.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
            },
        ),
    ),
}
CLASSES = {"phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_GEMMA_FIELDS = dict(
    embed_scale=True,
    norm_unit_offset=True,
    mlp_activation="gelu_tanh",
    norm_placement="sandwich",
    query_pre_attn_scalar=20.0,
    final_softcap=5.0,
    head_size=24,
    tie_embeddings=True,
    qkv_bias=True,
    o_bias=True,
    sliding_window=WINDOW,
    window_layers=[True, False, True],
)
# the trickles fields each family's import must set
FIELDS = {
    "phi3": dict(family="phi3", sliding_window=WINDOW, window_layers=None, rope_theta=30000.0, dropout=0.0),
    "gemma2": dict(_GEMMA_FIELDS, family="gemma2", attn_softcap=3.0, qk_norm="none", rope_theta=20000.0),
    "gemma3": dict(
        _GEMMA_FIELDS,
        family="gemma3_text",
        attn_softcap=None,
        qk_norm="head",
        rope_theta=20000.0,
        rope_type="linear",
        rope_factor=4.0,
        rope_local_theta=500.0,
    ),
}

_DIRS = {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(name)``: (the family's perturbed transformers model, the directory it is saved in), built once."""

    def get(name):
        if name not in _DIRS:
            config_class, extra = FAMILIES[name]
            with torch.random.fork_rng():
                torch.manual_seed(23 + list(FAMILIES).index(name))
                model = transformers.AutoModelForCausalLM.from_config(
                    config_class(**SHAPE, **extra), attn_implementation="eager"
                )
            g = torch.Generator().manual_seed(list(FAMILIES).index(name))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
            root = tmp_path_factory.mktemp(name)
            model.eval().save_pretrained(root / "hf")
            _DIRS[name] = (model, root / "hf")
        return _DIRS[name]

    return get


def tokens():
    return torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def hf_logits(model):
    return model(tokens()).logits


@torch.no_grad()
def our_logits(model):
    return model.eval()(tokens()).float()


def rel_err(ours, theirs):
    assert ours.shape == theirs.shape
    return (ours - theirs).abs().max().item() / theirs.abs().max().item()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_export_and_generate_like_transformers(name, saved, tmp_path):
    hf, root = saved(name)
    ours = load_hf(root)
    for key, value in FIELDS[name].items():
        assert getattr(ours.cfg, key) == value, key
    expected = hf_logits(hf)
    assert rel_err(our_logits(ours), expected) <= 1e-5

    # greedy past the window; eos_token_id=None: transformers does not stop (or suppress) the end-of-sequence token
    prompt = tokens()[:1, :PROMPT]
    theirs = hf.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, NEW, temperature=0.0), theirs[:, PROMPT:])

    save_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [CLASSES[name]]
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == CLASSES[name]
    assert torch.equal(hf_logits(back.eval()), expected)
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(load_file(root / "model.safetensors"))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_projections_and_bf16(name, saved, tmp_path):
    """Phi-3's ``[q; k; v]`` and ``[gate; up]`` tensors (and the others' parts) read into fused projections, whose
    rows interleave by key/value group, and exported back exactly; a bf16 directory within bf16's tolerance."""
    hf, root = saved(name)
    fused = load_hf_as(root, fused_proj=True)
    assert hasattr(fused.layers["0"].attn, "qkv_proj")
    assert rel_err(our_logits(fused), hf_logits(hf)) <= 1e-5
    save_hf(fused, tmp_path / "out")  # the fused rows split back into the family's layout
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert torch.equal(hf_logits(back.eval()), hf_logits(hf))
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    half = load_hf(tmp_path / "bf16", dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert rel_err(our_logits(half), hf_logits(hf)) <= 3e-2


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_window_is_taken_as_written(name, saved, tmp_path):
    """transformers' mask uses ``sliding_window`` as the config says (Phi-3-mini's 2047 is 2047 keys): a model read
    with a window one shorter or longer than the one transformers ran is off by more than 1e-3."""
    hf, root = saved(name)
    expected = hf_logits(hf)
    for window in (WINDOW - 1, WINDOW + 1):
        (tmp_path / str(window)).mkdir()
        raw = json.loads((root / "config.json").read_text())
        (tmp_path / str(window) / "config.json").write_text(json.dumps({**raw, "sliding_window": window}))
        (tmp_path / str(window) / "model.safetensors").symlink_to(root / "model.safetensors")
        assert rel_err(our_logits(load_hf(tmp_path / str(window))), expected) > 1e-3


def _config(name, **changes):
    config_class, extra = FAMILIES[name]
    return {**config_class(**SHAPE, **extra).to_dict(), **changes}


@pytest.mark.parametrize(
    "name, changes, message",
    [
        ("phi3", dict(rope_parameters={"rope_type": "longrope"}), r"rope_type='longrope' \(per-dimension short"),
        ("phi3", dict(rope_scaling={"type": "su"}), r"rope_scaling.rope_type='su' \(per-dimension"),
        ("phi3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "with the default rotary only"),
        (
            "phi3",
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor=0.5 is not supported",
        ),
        ("gemma2", dict(hidden_activation="gelu"), r"hidden_activation='gelu' \(only gelu_pytorch_tanh\)"),
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
        ("gemma2", dict(layer_types=["sliding_attention"]), "give one entry per layer, 3"),
        ("gemma2", dict(layer_types=["chunked_attention"] * 3), "only sliding_attention and full_attention"),
        ("gemma2", dict(sliding_window=None), "sliding_window=None with sliding_attention layers"),
        ("gemma3", dict(attn_logit_softcapping=50.0), "Gemma3Attention does not apply it"),
        (
            "gemma3",
            dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
            "the sliding layers' rope is unscaled",
        ),
        ("gemma3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "one dict per layer type"),
        (
            "gemma3",
            dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}),
            "rope_parameters.full_attention: rope_parameters.rope_type='dynamic' is not supported",
        ),
    ],
)
def test_family_configs_refused_in_one_line(name, changes, message):
    with pytest.raises(CheckpointError, match=message) as e:
        config_from_hf(_config(name, **changes), "config.json")
    assert "\n" not in str(e.value)


def test_gemma3_reads_transformers_4_keys_and_default_pattern():
    """A 4.x Gemma 3 config.json (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
    ``sliding_window_pattern``, no ``layer_types``) imports as transformers 5.x's ``Gemma3TextConfig`` reads it."""
    raw = dict(
        _config("gemma3"),
        num_hidden_layers=7,
        rope_theta=30000.0,
        rope_local_base_freq=700.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
    )
    for key in ("rope_parameters", "layer_types"):
        del raw[key]
    ours = config_from_hf(raw, "config.json")
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert (
        ours.window_layers == [t == "sliding_attention" for t in theirs.layer_types] == [True, True, False] * 2 + [True]
    )
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope_theta, ours.rope_type, ours.rope_factor) == (full["rope_theta"], "linear", full["factor"])
    assert ours.rope_local_theta == local["rope_theta"] == 700.0 and local["rope_type"] == "default"
    assert config_from_hf(config_to_hf(ours, torch.float32), "config.json") == ours


def test_gemma2_null_soft_caps_are_off():
    """A null ``attn_logit_softcapping`` / ``final_logit_softcapping`` is off, as transformers reads it (not the
    defaults 50 and 30, which a config.json that leaves the fields out gets), and is written back null."""
    off = config_from_hf(_config("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None), "config.json")
    assert (off.attn_softcap, off.final_softcap) == (None, None)
    assert transformers.Gemma2Config(**config_to_hf(off, torch.float32)).attn_logit_softcapping is None
    raw = _config("gemma2")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        del raw[key]
    left_out = config_from_hf(raw, "config.json")
    assert (left_out.attn_softcap, left_out.final_softcap) == (50.0, 30.0)


GEMMA_PARTS = dict(
    embed_scale=True,
    norm_unit_offset=True,
    mlp_activation="gelu_tanh",
    norm_placement="sandwich",
    query_pre_attn_scalar=16.0,
    head_size=24,
    sliding_window=6,
    window_layers=[True, False],
)


@pytest.mark.parametrize(
    "shape, model_type",
    [
        (dict(family="phi3", sliding_window=6), "phi3"),
        (dict(GEMMA_PARTS, attn_softcap=4.0, final_softcap=6.0, qkv_bias=True, o_bias=True), "gemma2"),
        (dict(GEMMA_PARTS, qk_norm="head", final_softcap=6.0, rope_local_theta=300.0), "gemma3_text"),
    ],
    ids=["phi3", "gemma2", "gemma3"],
)
def test_trickles_models_export_as_their_family(shape, model_type, tmp_path):
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64, **shape)
    ours = build_model(cfg, seed=3)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_hf(ours, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == model_type
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert rel_err(hf_logits(hf), our_logits(ours)) <= 1e-5
    again = load_hf(tmp_path / "m").cfg
    for key, value in shape.items():
        assert getattr(again, key) == value, key


@pytest.mark.parametrize(
    "shape, message",
    [
        (dict(family="phi3", qkv_bias=True), "Phi-3 has no bias on its qkv projections"),
        (dict(family="phi3", sliding_window=4, window_layers=[True, False]), "window applies to every layer"),
        (dict(family="phi3", rope_type="linear", rope_factor=2.0), "default rotary only, but model.rope_type=linear"),
        (dict(GEMMA_PARTS, family="gemma2", embed_scale=False), "Gemma 2 has model.embed_scale=true, but this"),
        (dict(GEMMA_PARTS, rope_local_theta=300.0), "Gemma 2 has one rotary base for every layer"),
        (dict(GEMMA_PARTS, qk_norm="head", attn_softcap=3.0), "Gemma 3 has no attention soft-capping"),
        (dict(GEMMA_PARTS, qk_norm="head", rope_type="linear", rope_factor=2.0), "sliding layers have an unscaled"),
        (dict(GEMMA_PARTS, query_pre_attn_scalar=16.5), "query_pre_attn_scalar is an integer"),
        (dict(GEMMA_PARTS, family="gemma2", mlp_bias=True), r"Gemma 2 \(attention_bias\) has no bias on its mlp"),
        # a Gemma part on a model another family writes: refused, not written without it
        (dict(norm_unit_offset=True), "LlamaForCausalLM has no model.norm_unit_offset; set model.family=gemma2"),
        (dict(family="phi3", mlp_activation="gelu_tanh"), "Phi3ForCausalLM has no model.mlp_activation=gelu_tanh"),
        (dict(qk_norm="head", final_softcap=30.0), "Qwen3ForCausalLM has no model.final_softcap"),
        (dict(family="mistral", embed_scale=True), "MistralForCausalLM has no model.embed_scale"),
    ],
)
def test_unexportable_phi3_and_gemma_layouts(shape, message):
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16, **shape)
    with pytest.raises(ConfigError, match=message) as e:
        config_to_hf(cfg, torch.float32)
    assert "\n" not in str(e.value)
