"""Every refusal of a Hugging Face directory or export is pinned: a missing or damaged config, an index that does not
match its shards, a tied head that is not the embedding, an architecture trickles cannot represent, an export trickles
cannot write (docs/testing.md, "Refusals"). A one-layer model saved by :func:`save_hf`, then damaged."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from trickles.errors import CheckpointError, ConfigError
from trickles.models import ModelConfig, build_model, load_hf, save_hf
from trickles.models.hf_config import config_from_hf, config_to_hf

CFG = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32, max_seq_len=8)


def _raises(exc, message):
    return pytest.raises(exc, match=re.escape(message))


@pytest.fixture
def saved(tmp_path):
    return save_hf(build_model(CFG, seed=0), tmp_path / "hf")


def _as_index(root, names):
    """Replaces ``model.safetensors`` by an index naming ``names[tensor]`` as each tensor's shard (the tensors stay
    in ``shard.safetensors``)."""
    tensors = load_file(root / "model.safetensors")
    (root / "model.safetensors").rename(root / "shard.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: names(k) for k in tensors}}))
    return tensors


def test_a_directory_without_or_with_a_damaged_config_is_refused(saved):
    (saved / "config.json").write_text("{not json")
    with _raises(CheckpointError, "config.json is not valid JSON"):
        load_hf(saved)
    (saved / "config.json").unlink()
    with _raises(CheckpointError, "is not a Hugging Face model directory: "):
        load_hf(saved)


def test_an_index_that_does_not_match_its_shards_is_refused(saved):
    first = sorted(_as_index(saved, lambda k: "shard.safetensors"))[0]
    index = saved / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    for change, message in (
        ({first: "../shard.safetensors"}, "names shard files outside the directory: ['../shard.safetensors']"),
        ({first: "other.safetensors"}, "lists shard files that do not exist"),
        ({first: "empty.safetensors"}, f"places tensors in shards that do not hold them: ['{first}']"),
    ):
        save_file({"x": torch.zeros(1)}, saved / "empty.safetensors")
        index.write_text(json.dumps({"weight_map": {**weight_map, **change}}))
        with _raises(CheckpointError, message):
            load_hf(saved)
    index.write_text("{}")
    with _raises(CheckpointError, "is not a valid safetensors index (KeyError('weight_map'))"):
        load_hf(saved)


def test_a_tied_head_that_differs_from_the_embedding_is_refused(tmp_path):
    root = save_hf(build_model(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}), seed=0), tmp_path / "hf")
    tensors = load_file(root / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, root / "model.safetensors")
    with _raises(CheckpointError, "tie_word_embeddings is true but lm_head.weight differs from the token embedding"):
        load_hf(root)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_scaling": {"rope_type": "default", "inner": {"a": 1}}}, "is not one flat dict"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        ({"quantization_config": {"bits": 4}}, "the weights are quantized (quantization_config is set)"),
        (
            {"num_key_value_heads": 3},
            "describes a shape trickles cannot build: model.n_heads (2) must be a multiple of",
        ),
    ],
    ids=["rope-nested", "partial-rotary", "quantized", "shape"],
)
def test_llama_configs_trickles_cannot_represent_are_refused(change, message):
    raw = {**config_to_hf(CFG, torch.float32), **change}
    with _raises(CheckpointError, message):
        config_from_hf(raw, "config.json")


def test_a_mixtral_head_dim_other_than_hidden_over_heads_is_refused():
    moe = ModelConfig(**{**CFG.__dict__, "moe_experts": 2, "moe_top_k": 2, "moe_every": 1, "moe_capacity_factor": 0.0})
    raw = {**config_to_hf(moe, torch.float32), "head_dim": 4}
    with _raises(CheckpointError, "head_dim=4 differs from hidden_size/num_attention_heads=16/2"):
        config_from_hf(raw, "config.json")


def test_exports_trickles_cannot_write_are_refused(tmp_path):
    model = build_model(CFG, seed=0)
    (tmp_path / "file").write_text("")
    with _raises(CheckpointError, "exists and is not a directory; choose another path"):
        save_hf(model, tmp_path / "file")
    with _raises(ConfigError, "dtype 'int8' is not a floating-point torch dtype"):
        save_hf(model, tmp_path / "int8", dtype="int8")
    del model.layers["0"]  # a part of the model (a pipeline stage's), not the whole
    with _raises(CheckpointError, "cannot export: the model has no ['layers.0."):
        save_hf(model, tmp_path / "part")
    gpt2 = ModelConfig(flavor="gpt2", n_layers=1, d_model=16, n_heads=2, head_size=4, vocab_size=32, max_seq_len=8)
    with _raises(ConfigError, "GPT-2's heads are d_model / n_heads wide, but model.head_size=4"):
        config_to_hf(gpt2, torch.float32)


def test_a_shard_that_fails_while_its_tensors_are_read_is_refused(saved, monkeypatch):
    """A read error after the header was read (a disk failing, a file changed underneath): CheckpointError naming the
    file, not a traceback from the library (a truncated file is refused earlier, by its header)."""
    import trickles.models.hf as hf

    opened = hf.safe_open

    class Failing:
        def __init__(self, *args, **kwargs):
            self.f = opened(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def get_tensor(self, name):
            raise OSError("read failed")

    monkeypatch.setattr(hf, "safe_open", Failing)
    with _raises(CheckpointError, "model.safetensors: read failed"):
        load_hf(saved)
