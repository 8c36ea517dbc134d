"""The mixture-of-experts presets (Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): each builds (on the meta device) to exactly
the parameters transformers builds from the exported config.json; its total is within 1% of its model card's and its
active parameters (a token's: the router, the top-k routed and the shared experts) within 2% (the cards round them to
two figures); it exports as its family with its routing."""

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trickles.config import Config
from trickles.memory.meta import rank_model
from trickles.models.hf import config_to_hf
from trickles.topology import ParallelDims

# preset: (total, active parameters in billions as the model cards state them, model_type)
RELEASED = {
    "qwen2-57b-a14b": (57.41, 14.25, "qwen2_moe"),  # the card: 57B total, 14B active
    "qwen3-30b-a3b": (30.5, 3.3, "qwen3_moe"),
    "qwen3-235b-a22b": (235.0, 22.0, "qwen3_moe"),
    "deepseek-v3": (671.0, 37.0, "deepseek_v3"),  # without the multi-token-prediction module's 14B
}


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_a_mixture_of_experts_preset_has_its_parameters_and_family(preset):
    total, active, model_type = RELEASED[preset]
    cfg = Config.load(None, [f"model.preset={preset}", "data.seq_len=128"]).model
    cfg = dataclasses.replace(cfg, max_seq_len=128)
    counted = rank_model(cfg, ParallelDims(), False, 0, torch.bfloat16)
    assert abs(counted.total_params / 1e9 - total) <= 0.01 * total, (preset, counted.total_params)
    assert abs(counted.active_params / 1e9 - active) <= 0.02 * active, (preset, counted.active_params)
    hf = config_to_hf(cfg, torch.bfloat16)
    assert hf["model_type"] == model_type
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf)).num_parameters()
    assert counted.total_params == theirs, (preset, counted.total_params, theirs)
    if model_type == "deepseek_v3":
        assert (hf["first_k_dense_replace"], hf["n_group"], hf["topk_group"], hf["n_routed_experts"]) == (3, 8, 4, 256)
        assert cfg.moe_layers == list(range(3, 61)) and hf["rope_scaling"]["factor"] == 40.0
