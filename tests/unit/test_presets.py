"""The released models' presets: each builds (on the meta device) to exactly the parameters transformers builds from
the exported config.json, within 1% of what the model card states (the cards round, not always to nearest), and
exports as its family's ``model_type`` with its rotary scaling, so a preset cannot drift from the model it names."""

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trickles.config import Config
from trickles.models.hf import config_to_hf
from trickles.models.transformer import Transformer, count_params

# preset: (published parameters in billions as the model cards round them, model_type)
RELEASED = {
    "llama3.2-1b": (1.24, "llama"),
    "llama3.2-3b": (3.21, "llama"),
    "llama3.1-8b": (8.03, "llama"),
    "llama3.1-70b": (70.6, "llama"),
    "llama3.1-405b": (405.9, "llama"),
    "mistral-7b": (7.25, "mistral"),
    "qwen2.5-7b": (7.61, "qwen2"),
    "qwen2.5-72b": (72.7, "qwen2"),
    "qwen3-0.6b": (0.60, "qwen3"),
    "qwen3-8b": (8.19, "qwen3"),
    "qwen3-32b": (32.8, "qwen3"),
    "gemma2-9b": (9.24, "gemma2"),
    "gemma2-27b": (27.2, "gemma2"),
    # the Gemma 3 report's embedding plus non-embedding parameters (1,012M + 10,759M): the card's 12B adds vision
    "gemma3-12b": (11.77, "gemma3_text"),
    "phi3-mini": (3.82, "phi3"),
}


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_a_released_models_preset_has_its_parameters_and_family(preset):
    billions, model_type = RELEASED[preset]
    cfg = Config.load(None, [f"model.preset={preset}", "data.seq_len=128"]).model
    cfg = dataclasses.replace(cfg, max_seq_len=128)
    with torch.device("meta"):
        model = Transformer(cfg)
    ours = count_params(model)
    assert abs(ours / 1e9 - billions) <= 0.01 * billions, (preset, ours)
    hf = config_to_hf(cfg, torch.bfloat16)
    assert hf["model_type"] == model_type
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf)).num_parameters()
    assert ours == theirs, (preset, ours, theirs)
    if preset.startswith("llama3"):
        assert hf["rope_scaling"]["rope_type"] == "llama3" and hf["rope_theta"] == 500000.0
    if preset.startswith("gemma3"):
        rope = AutoConfig.for_model(**hf).rope_parameters
        assert rope["full_attention"]["factor"] == 8.0 and rope["sliding_attention"]["rope_theta"] == 1e4
