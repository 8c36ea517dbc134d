"""Hugging Face import/export: logits agree with ``transformers`` both ways, bad inputs are refused."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", exc_type=ImportError
)  # a broken install skips too (CI=true fails it)

from safetensors.torch import load_file, save_file  # noqa: E402
from test_families import assert_close as assert_relative  # noqa: E402

from trickles.errors import CheckpointError, ConfigError  # noqa: E402
from trickles.models import ModelConfig, build_model, load_hf, save_hf  # noqa: E402

VOCAB, SEQ = 211, 12
ATTN = "sdpa"


def perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Adds noise to every parameter (HF initializes norms and biases to constants)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def llama_hf(tied: bool):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    return perturb(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN), 1)


def gpt2_hf(tied: bool = True):
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=32,
        tie_word_embeddings=tied,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    return perturb(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN), 2)


def mixtral_hf(tied: bool = False, **extra):
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        rope_theta=5000.0,
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.02,
        tie_word_embeddings=tied,
        **extra,
    )
    return perturb(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTN), 5)


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def hf_logits(model):
    return model(tokens()).logits


@torch.no_grad()
def our_logits(model):
    return model.eval()(tokens())


def load_transformers(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation=ATTN
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.dtype == torch.float32
    return model.eval()


def assert_close(a, b):
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "make",
    [lambda: llama_hf(False), lambda: llama_hf(True), gpt2_hf, lambda: gpt2_hf(False)],
    ids=["llama", "llama-tied", "gpt2", "gpt2-untied"],
)
def test_transformers_to_trickles_and_back(make, tmp_path):
    hf = make()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_hf(tmp_path / "hf")
    assert ours.cfg.tied == hf.config.tie_word_embeddings
    assert next(ours.parameters()).dtype == torch.float32
    expected = hf_logits(hf)
    assert_close(our_logits(ours), expected)

    save_hf(ours, tmp_path / "out")
    back = load_transformers(tmp_path / "out")
    assert_close(hf_logits(back), expected)
    assert back.config.eos_token_id == hf.config.eos_token_id
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert ("lm_head.weight" in written) == (not hf.config.tie_word_embeddings)
    assert set(written) == set(load_file(tmp_path / "hf" / "model.safetensors"))


@pytest.mark.parametrize(
    "shape",
    [
        dict(flavor="llama", n_kv_heads=2, tie_embeddings=False),
        dict(flavor="llama", n_kv_heads=2, tie_embeddings=True, rope_theta=500000.0),
        dict(flavor="llama", n_kv_heads=None, ffn_hidden=80),
        dict(flavor="gpt2", n_kv_heads=None),
    ],
    ids=["llama", "llama-tied", "llama-mha", "gpt2"],
)
def test_trickles_to_transformers(shape, tmp_path):
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=VOCAB, max_seq_len=32, norm_eps=1e-6, **shape)
    ours = perturb(build_model(cfg, seed=3), 4)
    save_hf(ours, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == cfg.flavor and config["torch_dtype"] == config["dtype"] == "float32"
    hf = load_transformers(tmp_path / "m")
    assert hf.config.tie_word_embeddings == cfg.tied
    assert_close(hf_logits(hf), our_logits(ours))

    again = load_hf(tmp_path / "m")
    assert again.cfg.ffn_dim == cfg.ffn_dim and again.cfg.kv_heads == cfg.kv_heads
    assert again.cfg.rope_theta == cfg.rope_theta and again.cfg.norm_eps == cfg.norm_eps
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_sharded_checkpoint_and_dtype(tmp_path):
    hf = gpt2_hf()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert_close(our_logits(load_hf(tmp_path / "hf")), hf_logits(hf))

    half = load_hf(tmp_path / "hf", dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.output.weight is half.embed.weight
    save_hf(half, tmp_path / "bf16", dtype=torch.float16)
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.float16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "float16"


def test_save_into_existing_directory_keeps_other_files(tmp_path):
    out = tmp_path / "m"
    gpt2_hf().save_pretrained(out, max_shard_size="60KB")
    (out / "tokenizer.json").write_text("{}")
    ours = build_model(
        ModelConfig(flavor="llama", n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16), 0
    )
    save_hf(ours, out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert load_hf(out).cfg.flavor == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    gqa = build_model(
        ModelConfig(flavor="gpt2", n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16), 0
    )
    with pytest.raises(ConfigError, match="n_kv_heads"):
        save_hf(gqa, tmp_path / "a")
    ok = build_model(
        ModelConfig(flavor="gpt2", n_layers=1, d_model=32, n_heads=4, n_kv_heads=None, vocab_size=64, max_seq_len=16), 0
    )

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("trickles.models.hf_export.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_hf(ok, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_pickle_only_directory_is_refused(tmp_path):
    llama_hf(False).save_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safe_serialization=True"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="gptj"), r"model_type 'gptj' is not supported; load_hf reads .*'gpt2' \(GPT2LMHeadModel\), "),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type='dynamic'"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0}), "rope_parameters.rope_type='longrope'"),
        # attention_bias on a checkpoint without biases: the first missing tensor named
        (dict(attention_bias=True), r"missing tensors \['model\.layers\.0\.self_attn\.k_proj\.bias'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        # an explicit head_dim is model.head_size (pruned models, tests/unit/test_prune.py); one the weights do not
        # have is refused
        (dict(head_dim=32), r"q_proj\.weight has shape \[64, 64\], but config.json implies \[128, 64\]"),
        (dict(rope_theta=1.0, rope_parameters={"rope_type": "default", "rope_theta": 2.0}), "disagrees"),
    ],
)
def test_unsupported_llama_configs(changes, message, tmp_path):
    llama_hf(False).save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(activation_function="relu"), "activation_function='relu'"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=true"),
        (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn=true"),
    ],
)
def test_unsupported_gpt2_configs(changes, message, tmp_path):
    gpt2_hf().save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_hf(tmp_path)


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    gpt2_hf().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    good = dict(weights)
    weights.pop("transformer.h.1.mlp.c_fc.bias")
    weights["transformer.h.1.adapter.weight"] = torch.zeros(2)
    weights["transformer.h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # an old causal-mask buffer: ignored
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=r"missing tensors \['transformer\.h\.1\.mlp\.c_fc\.bias'\].*"
        r"unexpected tensors \['transformer\.h\.1\.adapter\.weight'\]",
    ):
        load_hf(tmp_path)

    good["transformer.h.0.attn.c_attn.weight"] = torch.zeros(64, 190)
    save_file(good, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"c_attn\.weight has shape \[64, 190\].*\[64, 192\]"):
        load_hf(tmp_path)

    good["transformer.h.0.attn.c_attn.weight"] = torch.zeros(64, 192, dtype=torch.int8)
    save_file(good, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="stored as torch.int8"):
        load_hf(tmp_path)

    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        load_hf(tmp_path)


def test_unprefixed_gpt2_checkpoint(tmp_path):
    """The original ``gpt2`` upload names tensors ``wte.weight``, ``h.0...`` and stores causal masks."""
    hf = gpt2_hf()
    hf.save_pretrained(tmp_path)
    weights = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    weights["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert_close(our_logits(load_hf(tmp_path)), hf_logits(hf))


# ---- Mixtral -----------------------------------------------------------------------------

MOE = dict(
    flavor="llama",
    n_layers=2,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=VOCAB,
    max_seq_len=32,
    moe_experts=4,
    moe_top_k=2,
    moe_ffn_hidden=48,
)


def _per_expert_names(path):
    return {k for k in load_file(path / "model.safetensors") if "block_sparse_moe.experts." in k}


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "fused"])
def test_mixtral_to_trickles_and_back(original_format, tmp_path):
    """transformers 5.x writes the per-expert layout by default, its modules' fused one on request."""
    hf = mixtral_hf()
    hf.save_pretrained(tmp_path / "hf", save_original_format=original_format)
    assert bool(_per_expert_names(tmp_path / "hf")) == original_format
    ours = load_hf(tmp_path / "hf")
    c = ours.cfg
    assert (c.moe_experts, c.moe_top_k, c.moe_every, c.moe_ffn_dim, c.kv_heads) == (4, 2, 1, 48, 2)
    assert (c.moe_capacity_factor, c.moe_shared_experts, c.moe_aux_loss, c.moe_z_loss, c.rope_theta) == (
        0,
        0,
        0.02,
        0,
        5000.0,
    )
    expected = hf_logits(hf)
    assert_close(our_logits(ours), expected)

    save_hf(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["architectures"] == ["MixtralForCausalLM"]
    back = load_transformers(tmp_path / "out")
    assert_close(hf_logits(back), expected)
    written = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert len(_per_expert_names(tmp_path / "out")) == 2 * 4 * 3
    if original_format:
        assert written == set(load_file(tmp_path / "hf" / "model.safetensors"))


@pytest.mark.parametrize(
    "shape", [dict(), dict(moe_top_k=3, tie_embeddings=True, n_kv_heads=None)], ids=["top2", "top3-tied-mha"]
)
def test_trickles_moe_to_transformers(shape, tmp_path):
    cfg = ModelConfig(**{**MOE, **shape})
    ours = perturb(build_model(cfg, seed=3), 6)
    save_hf(ours, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (
        4,
        cfg.moe_top_k,
        48,
    )
    assert config["sliding_window"] is None and config["router_aux_loss_coef"] == cfg.moe_aux_loss
    hf = load_transformers(tmp_path / "m")
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.tie_word_embeddings == cfg.tied
    assert_close(hf_logits(hf), our_logits(ours))

    again = load_hf(tmp_path / "m")
    assert (again.cfg.moe_experts, again.cfg.moe_top_k, again.cfg.moe_ffn_dim) == (4, cfg.moe_top_k, 48)
    assert list(again.state_dict()) == list(ours.state_dict())
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(moe_shared_experts=1), "no shared experts.*moe_shared_experts=0"),
        (dict(moe_capacity_factor=1.25), "dropless.*moe_capacity_factor=0"),
        (dict(moe_every=2), "every block.*moe_every=1"),
        (dict(moe_top_k=1), "moe_top_k >= 2"),
        (dict(moe_router="hard", moe_label_experts=["a:0+1", "b:2+3"]), "moe_router=learned"),
        (dict(flavor="gpt2", n_kv_heads=None), "no GPT-2 mixture of experts"),
    ],
)
def test_unexportable_moe_models(changes, message, tmp_path):
    model = build_model(ModelConfig(**{**MOE, **changes}), 0)
    with pytest.raises(ConfigError, match=message) as err:
        save_hf(model, tmp_path / "m")
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_experts_per_tok=1), "num_experts_per_tok=1"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 4.0}), "rope_type=.dynamic."),
    ],
)
def test_unsupported_mixtral_configs(changes, message, tmp_path):
    mixtral_hf().save_pretrained(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message) as err:
        load_hf(tmp_path)
    assert "\n" not in str(err.value)


@torch.no_grad()
def test_mixtral_sliding_window_like_transformers(tmp_path):
    """Mixtral's window slides on every layer, as Mistral's; 24 tokens through a window of 8."""
    hf = mixtral_hf(sliding_window=8)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    assert (ours.cfg.sliding_window, ours.cfg.window_layers) == (8, None)
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    theirs = hf(x).logits
    assert_relative(ours(x).float(), theirs)
    hf.config.sliding_window = None  # the window cuts: full attention is far off
    assert (hf(x).logits - theirs).abs().max() > 1e-3
    save_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 8
    assert_relative(load_transformers(tmp_path / "out")(x).logits, theirs)
