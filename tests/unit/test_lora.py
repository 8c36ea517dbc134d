"""LoRA adapters (trickles.adapters): the update's math, the frozen base, merging, and PEFT's format read back by
``peft`` onto the original Hugging Face model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trickles.adapters import LoRASettings, apply_lora, merge_lora
from trickles.adapters.lora import adapter_initial_value
from trickles.adapters.peft import save_peft
from trickles.errors import ConfigError
from trickles.models.config import ModelConfig
from trickles.models.transformer import build_model, param_seed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _tiny(**kw) -> ModelConfig:
    base = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, ffn_hidden=48)
    return ModelConfig(**{**base, **kw})


def _randomize_adapters(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_update_frozen_base_and_merge():
    model = build_model(_tiny(), seed=1)
    tokens = torch.randint(0, 64, (2, 12))
    base_logits = model(tokens)
    s = LoRASettings(rank=4, alpha=8.0)
    names = apply_lora(model, s)
    assert len(names) == 2 * 7
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{m}.lora_{x}.weight" for m in names for x in "AB"
    }
    # B starts at zero: the adapted model starts exactly at its base
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data.copy_(adapter_initial_value(n, tuple(p.shape), 1, param_seed))
    assert torch.equal(model(tokens), base_logits)
    _randomize_adapters(model)
    q = model.layers["0"].attn.q_proj
    x = torch.randn(3, 32)
    want = x @ q.weight.T + 2.0 * (x @ q.lora_A.weight.T) @ q.lora_B.weight.T
    torch.testing.assert_close(q(x), want)
    adapted = model(tokens)
    assert not torch.allclose(adapted, base_logits)
    adapted.sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    merge_lora(model)
    assert not any("lora_" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(model(tokens), adapted, rtol=1e-5, atol=1e-5)


def test_bad_settings_one_line():
    model = build_model(_tiny(), seed=1)
    with pytest.raises(ConfigError, match="lora_targets names 'c_attn'"):
        apply_lora(model, LoRASettings(rank=4, alpha=8.0, targets=("c_attn",)))
    with pytest.raises(ConfigError, match="at most 16"):  # k_proj: [16, 32]
        apply_lora(model, LoRASettings(rank=17, alpha=8.0))
    with pytest.raises(ConfigError, match="at least 1"):
        apply_lora(model, LoRASettings(rank=0, alpha=8.0))


def test_peft_export_loads_in_peft(tmp_path):
    from trickles.models.hf import load_hf, save_hf

    hf_cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "base")
    model = load_hf(tmp_path / "base")
    s = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    apply_lora(model, s)
    _randomize_adapters(model)
    save_peft(model, tmp_path / "adapter", s, base=str(tmp_path / "base"))
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ours = model(tokens)
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    merge_lora(model)
    save_hf(model, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())


def test_fused_projections_keep_one_adapter_per_part(tmp_path):
    """A fused model's adapters (one per part of qkv_proj and gate_up_proj) start where the unfused model's start,
    compute what the unfused model with the same adapters computes, merge, and export to PEFT's per-module names."""
    from trickles.adapters.lora import part_name

    s = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"))
    plain, fused = build_model(_tiny(fused_proj=False), seed=1), build_model(_tiny(fused_proj=True), seed=1)
    apply_lora(plain, s)
    apply_lora(fused, s)
    p_named, f_named = dict(plain.named_parameters()), dict(fused.named_parameters())
    adapters = sorted(n for n in f_named if "lora_" in n)
    assert sorted(part_name(n) for n in adapters) == sorted(n for n in p_named if "lora_" in n)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in adapters:
            value = torch.randn(f_named[n].shape, generator=g) * 0.1
            f_named[n].copy_(value)
            p_named[part_name(n)].copy_(value)
        assert torch.equal(
            adapter_initial_value(adapters[0], (4, 32), 1, param_seed),
            adapter_initial_value(part_name(adapters[0]), (4, 32), 1, param_seed),
        )
    tokens = torch.randint(0, 64, (2, 12))
    want = plain(tokens)
    torch.testing.assert_close(fused(tokens), want, rtol=1e-5, atol=1e-5)
    save_peft(fused, tmp_path / "f", s)
    save_peft(plain, tmp_path / "p", s)
    from safetensors.torch import load_file

    f, p = (
        load_file(tmp_path / "f" / "adapter_model.safetensors"),
        load_file(tmp_path / "p" / "adapter_model.safetensors"),
    )
    assert f.keys() == p.keys() and all(torch.equal(f[k], p[k]) for k in f)
    merge_lora(fused)
    torch.testing.assert_close(fused(tokens), want, rtol=1e-5, atol=1e-5)
