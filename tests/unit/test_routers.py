"""Routers as a part: DeepSeek-V3's group-limited sigmoid routing, Qwen2-MoE's gated shared expert and Qwen3-MoE's
normalized softmax against transformers' blocks with the same weights; the config's one-line refusals; and
auxiliary-loss-free balancing bringing a skewed router's load down."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from trickles.errors import ConfigError
from trickles.models.config import ModelConfig
from trickles.models.moe import MoE, MoEStats
from trickles.models.routers import update_router_bias

D, F_EXPERT = 32, 16


def _cfg(**moe) -> ModelConfig:
    cfg = ModelConfig(
        d_model=D, n_heads=4, n_layers=1, vocab_size=64, moe_ffn_hidden=F_EXPERT, moe_aux_loss=0.0, moe_z_loss=0.0
    )
    for k, v in moe.items():
        setattr(cfg, k, v)
    cfg.validate()
    return cfg


def _ours(cfg: ModelConfig) -> MoE:
    layer = MoE(cfg, 0, MoEStats())
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def _copy_in(layer: MoE, hf: torch.nn.Module, shared: str | None) -> None:
    """``hf``'s block (router ``gate``, fused ``experts``) takes ``layer``'s weights."""
    ex = layer.experts
    with torch.no_grad():
        hf.gate.weight.copy_(layer.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([ex.gate_proj.weight, ex.up_proj.weight], 1))
        hf.experts.down_proj.copy_(ex.down_proj.weight)
        if shared is not None:
            for w in ("gate_proj", "up_proj", "down_proj"):
                getattr(getattr(hf, shared), w).weight.copy_(getattr(layer.shared, w).weight)


def test_deepseek_v3_group_limited_sigmoid_matches_transformers():
    torch.manual_seed(0)
    cfg = _cfg(
        moe_experts=16,
        moe_top_k=3,
        moe_shared_experts=1,
        moe_router_score="sigmoid",
        moe_groups=4,
        moe_topk_groups=2,
        moe_routed_scale=2.5,
        moe_norm_topk=True,
    )
    ours = _ours(cfg)
    hf_cfg = DeepseekV3Config(
        hidden_size=D,
        moe_intermediate_size=F_EXPERT,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    hf = DeepseekV3MoE(hf_cfg).float()
    _copy_in(ours, hf, "shared_experts")
    bias = torch.randn(16) * 0.3  # large enough to change the choice of groups and experts
    with torch.no_grad():
        ours.router.e_score_correction_bias.copy_(bias)
        hf.gate.e_score_correction_bias.copy_(bias)
    x = torch.randn(3, 10, D)
    assert (ours(x) - hf(x)).abs().max() < 1e-5
    # the bias and the groups both change the routes: without them the outputs differ
    with torch.no_grad():
        ours.router.e_score_correction_bias.zero_()
    assert (ours(x) - hf(x)).abs().max() > 1e-3
    ours.router.e_score_correction_bias.data.copy_(bias)
    ours.router.topk_groups = 4
    assert (ours(x) - hf(x)).abs().max() > 1e-3


@pytest.mark.parametrize("norm", [False, True])
def test_qwen2_moe_gated_shared_expert_matches_transformers(norm):
    torch.manual_seed(1)
    cfg = _cfg(
        moe_experts=8,
        moe_top_k=2,
        moe_norm_topk=norm,
        moe_shared_experts=1,
        moe_shared_ffn_hidden=24,
        moe_shared_gate=True,
    )
    ours = _ours(cfg)
    assert ours.shared.down_proj.weight.shape == (D, 24)
    hf = Qwen2MoeSparseMoeBlock(
        Qwen2MoeConfig(
            hidden_size=D,
            moe_intermediate_size=F_EXPERT,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=norm,
        )
    ).float()
    _copy_in(ours, hf, "shared_expert")
    with torch.no_grad():
        hf.shared_expert_gate.weight.copy_(ours.shared_gate.weight)
    x = torch.randn(2, 12, D)
    assert (ours(x) - hf(x)).abs().max() < 1e-5


def test_qwen3_moe_normalized_softmax_matches_transformers():
    torch.manual_seed(2)
    cfg = _cfg(moe_experts=8, moe_top_k=1, moe_norm_topk=True)  # k = 1 normalized: the expert's weight is 1
    ours = _ours(cfg)
    hf = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(
            hidden_size=D, moe_intermediate_size=F_EXPERT, num_experts=8, num_experts_per_tok=1, norm_topk_prob=True
        )
    ).float()
    _copy_in(ours, hf, None)
    x = torch.randn(2, 12, D)
    assert (ours(x) - hf(x)).abs().max() < 1e-5


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(moe_experts=8, moe_groups=3), "must divide model.moe_experts (8)"),
        (dict(moe_experts=8, moe_groups=4, moe_topk_groups=5), "model.moe_topk_groups must be between 1 and"),
        (dict(moe_experts=8, moe_top_k=5, moe_groups=4, moe_topk_groups=2), "model.moe_top_k (5) exceeds the 4"),
        (dict(moe_experts=8, moe_shared_gate=True), "set model.moe_shared_experts >= 1"),
        (dict(moe_experts=8, moe_bias_rate=-1.0), "model.moe_bias_rate must be at least 0"),
    ],
)
def test_routing_refusals_are_one_line(fields, message):
    with pytest.raises(ConfigError) as err:
        _cfg(**fields)
    assert message in str(err.value) and "\n" not in str(err.value)


def _imbalance(score: str, rate: float, steps: int = 60) -> tuple[float, float]:
    """max/mean expert load of a router skewed towards expert 0, first and last of ``steps`` training steps that
    update the bias by ``rate`` (no auxiliary loss)."""
    torch.manual_seed(3)
    cfg = _cfg(moe_experts=8, moe_top_k=2, moe_router_score=score, moe_bias_rate=rate)
    layer = _ours(cfg)
    direction = torch.randn(D)
    with torch.no_grad():  # every token leans on a shared direction the router ties to experts 0 and 1
        layer.router.weight[:2] += 4.0 * direction / direction.norm()
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    ratios = []
    for _ in range(steps):
        x = torch.randn(4, 16, D) + direction / direction.norm()
        loss = (layer(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        load = layer.stats.load[0].double()  # dropless: every routed assignment is kept
        ratios.append(float(load.max() / load.mean()))
        layer.stats.reset()
        update_router_bias(layer, [])
    return sum(ratios[:3]) / 3, sum(ratios[-10:]) / 10


def test_bias_balancing_brings_the_load_down():
    start, end = _imbalance("sigmoid", 0.01)
    assert start > 2.5, start  # skewed: experts 0 and 1 take most tokens (4: all of them)
    assert end < 1.6, (start, end)
    _, unbalanced = _imbalance("sigmoid", 0.0)
    assert unbalanced > 2.5, unbalanced  # the training alone does not balance it
    # softmax scores: the idle experts' probabilities are close together, so the sign steps jitter more
    start, end = _imbalance("softmax", 0.01)
    assert end < 0.75 * start, (start, end)


def test_bias_is_a_persistent_buffer_that_only_chooses():
    cfg = _cfg(moe_experts=4, moe_top_k=2, moe_bias_rate=0.1)
    layer = _ours(cfg)
    assert "router.e_score_correction_bias" in layer.state_dict()
    assert "router.e_score_correction_bias" not in dict(layer.named_parameters())
    x = torch.randn(1, 8, D)
    layer.router.e_score_correction_bias.data = torch.tensor([0.0, 0.0, -5.0, -5.0])  # experts 2, 3 never chosen
    _, experts, weights = layer.router.choose(layer.router(x))
    assert set(experts.flatten().tolist()) == {0, 1}
    assert torch.allclose(weights.sum(-1), torch.ones(1, 8))  # weights from the unbiased scores, normalized


QWEN_MOE = {
    "qwen2_moe": (
        Qwen2MoeConfig,
        dict(shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1),
        dict(moe_shared_gate=True, moe_shared_ffn_hidden=48, moe_norm_topk=False, moe_every=1, qkv_bias=True),
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        dict(head_dim=24, attention_bias=True, norm_topk_prob=True, decoder_sparse_step=2),
        dict(moe_shared_experts=0, moe_norm_topk=True, moe_every=2, qk_norm="head", head_size=24),
    ),
}


@pytest.mark.parametrize("name", list(QWEN_MOE))
def test_qwen_moe_families_import_and_export_like_transformers(name, tmp_path):
    """A tiny perturbed transformers model: imported logits within 1e-5 (relative to the largest), greedy generation
    token-identical, and the export reloads as the same class with the same logits and tensor names."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trickles.models import load_hf, save_hf
    from trickles.models.generate import generate

    config_class, extra, fields = QWEN_MOE[name]
    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    shape.update(num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, rope_theta=30000.0)
    with torch.random.fork_rng():
        torch.manual_seed(5)
        hf = AutoModelForCausalLM.from_config(config_class(**shape, **moe, **extra), attn_implementation="sdpa")
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape) * 0.1)
    hf.eval().save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    assert ours.cfg.family == name and ours.cfg.moe_experts == 8
    for key, value in fields.items():
        assert getattr(ours.cfg, key) == value, key
    tokens = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(tokens).logits, ours(tokens).float()
    assert (mine - theirs).abs().max() / theirs.abs().max() < 1e-5
    prompt = tokens[:1]
    greedy = hf.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
    assert torch.equal(generate(ours, prompt, 8, temperature=0.0), greedy[:, prompt.shape[1] :])

    save_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == name
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back) is type(hf)
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens).logits, theirs)
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(
        load_file(tmp_path / "hf" / "model.safetensors")
    )
