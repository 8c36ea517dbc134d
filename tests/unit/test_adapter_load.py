"""Reading LoRA adapters for serving (trickles.adapters.loaded): PEFT directories written by ``peft`` itself and a
trickles LoRA run become ``{module: (A, s B)}`` over our unfused linears; merged into our imported model
(``W + s B A``) they give the logits of transformers + peft; the one-line refusals.

Tiny random models built by transformers (Llama; Phi-3's fused ``qkv_proj`` / ``gate_up_proj``; GPT-2's ``Conv1D``
and fused ``c_attn``), adapters made by ``peft`` with ``init_lora_weights=False`` so ``B`` is not zero."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from trickles.adapters.loaded import check_adapter_dir, load_adapter
from trickles.errors import CheckpointError, ConfigError
from trickles.models import fused as fusion

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 96
SHAPE = dict(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32, bos_token_id=1, eos_token_id=2)
LLAMA = dict(SHAPE, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_key_value_heads=2, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False),
    "phi3": lambda: transformers.Phi3Config(**LLAMA, tie_word_embeddings=False),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32),
}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: (family, PEFT's LoraConfig arguments)
ADAPTERS = {
    "plain": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])),
    "patterns": (
        "llama",
        dict(
            r=2,
            lora_alpha=6,
            use_rslora=True,
            target_modules=ALL,
            rank_pattern={"k_proj": 3, "layers.1.mlp.up_proj": 5, "model.layers.0.self_attn.q_proj": 4},
            alpha_pattern={"o_proj": 3.0, r"layers\.0\.mlp\.down_proj": 11.0},
        ),
    ),
    "fused": ("phi3", dict(r=3, lora_alpha=5, target_modules=["qkv_proj", "gate_up_proj", "o_proj"])),
    "conv1d": ("gpt2", dict(r=4, lora_alpha=4, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)),
}
_MODELS: dict = {}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``family(name)``: (transformers' model, our import of it), built once per family."""
    from trickles.models.hf import load_hf

    def get(name):
        if name not in _MODELS:
            torch.manual_seed(list(CONFIGS).index(name))
            hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager").eval()
            root = tmp_path_factory.mktemp(name) / "hf"
            hf.save_pretrained(root)
            _MODELS[name] = (hf, load_hf(root).eval())
        return _MODELS[name]

    return get


def peft_adapter(family, case: str, root) -> tuple:
    """(the peft model of adapter ``case``, our model, the directory peft saved the adapter in)."""
    name, kwargs = ADAPTERS[case]
    hf, ours = family(name)
    torch.manual_seed(7)
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(init_lora_weights=False, **kwargs)).eval()
    with torch.no_grad():  # peft's random B makes s B A several times W; a tenth of it still moves every logit
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.1)
    model.save_pretrained(root / case)
    return model, ours, root / case


def merged(model: torch.nn.Module, weights: dict) -> torch.nn.Module:
    """A copy of ``model`` with every adapter folded into its weight: ``W + B A`` (B already scaled)."""
    out = copy.deepcopy(model)
    state = fusion.split_state(out.cfg, out.state_dict())
    for module, (a, b) in weights.items():
        state[module + ".weight"] = state[module + ".weight"] + b @ a
    out.load_state_dict(fusion.fuse_state(out.cfg, state))
    return out


@pytest.mark.parametrize("case", list(ADAPTERS))
def test_peft_adapter_merged_gives_peft_logits(family, case, tmp_path):
    theirs_model, ours, path = peft_adapter(family, case, tmp_path)
    assert check_adapter_dir(str(path)) == "peft"
    adapter = load_adapter(str(path), ours.cfg, "mine")
    assert adapter.name == "mine" and adapter.path == str(path)
    assert all(a.dtype == b.dtype == torch.float32 for a, b in adapter.weights.values())
    ranks = {m: a.shape[0] for m, (a, _) in adapter.weights.items()}
    if case == "patterns":
        assert len(ranks) == 2 * 7 and adapter.rank == 5
        assert ranks["layers.0.attn.k_proj"] == 3 and ranks["layers.1.mlp.up_proj"] == 5
        assert (
            ranks["layers.0.attn.q_proj"] == 4 and ranks["layers.0.mlp.up_proj"] == ranks["layers.1.attn.q_proj"] == 2
        )
    if case == "fused":  # every part of a fused module: the whole A, its rows of B
        parts = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj"]
        assert set(ranks) == {f"layers.{i}.{m}" for i in (0, 1) for m in parts}
        assert ranks["layers.0.mlp.gate_proj"] == 3 and adapter.weights["layers.0.attn.k_proj"][1].shape == (16, 3)
        assert torch.equal(adapter.weights["layers.1.attn.q_proj"][0], adapter.weights["layers.1.attn.v_proj"][0])
    tokens = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = theirs_model(tokens).logits
        base = ours(tokens)
        mine = merged(ours, adapter.weights)(tokens)
    scale = theirs.abs().max().item()
    assert (base - theirs).abs().max().item() > 1e-2 * scale  # the adapter matters
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * scale)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """``(tmp, checkpoint)`` of a one-step LoRA run (fused projections, rank 4, alpha 6)."""
    from helpers import trained_checkpoint

    tmp = tmp_path_factory.mktemp("lora_run")
    overrides = ("train.lora_rank=4", "train.lora_alpha=6", "train.warmup_steps=0", "model.fused_proj=true")
    return tmp, trained_checkpoint(tmp, 1, *overrides)


def test_trickles_lora_run_gives_its_A_and_scaled_B(lora_run):
    from trickles.adapters.lora import part_name
    from trickles.train.load import load_for_inference

    tmp_path, path = lora_run
    assert check_adapter_dir(str(tmp_path / "run")) == check_adapter_dir(path) == "run"
    model, _, meta = load_for_inference(path, merge_adapters=False)
    cfg = dataclasses.replace(model.cfg, fused_proj=False)  # the served model need not fuse as the run did
    adapter = load_adapter(str(tmp_path / "run"), cfg, "run")
    params = {part_name(n): p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapter.weights) == 2 * 7 and adapter.rank == 4
    for module, (a, b) in adapter.weights.items():
        assert torch.equal(a, params[module + ".lora_A.weight"])
        assert b.abs().max() > 0 and torch.equal(b, 1.5 * params[module + ".lora_B.weight"])  # s = 6 / 4
    base = fusion.split_state(model.cfg, {n: t for n, t in model.state_dict().items() if "lora_" not in n})
    want = fusion.split_state(model.cfg, load_for_inference(path)[0].state_dict())  # merge_lora's W + s B A
    for module, (a, b) in adapter.weights.items():
        torch.testing.assert_close(base[module + ".weight"] + b @ a, want[module + ".weight"], rtol=1e-6, atol=1e-6)
    with pytest.raises(CheckpointError, match=r"ffn_hidden=128 there, 96 here") as e:
        load_adapter(path, dataclasses.replace(cfg, ffn_hidden=96), "run")
    assert "\n" not in str(e.value)
    plain = shutil.copytree(path, tmp_path / "plain" / os.path.basename(path))
    trainer = json.loads((plain / "trainer.json").read_text())
    trainer["config"]["train"]["lora_rank"] = 0
    (plain / "trainer.json").write_text(json.dumps(trainer))
    with pytest.raises(ConfigError, match=r"without adapters \(train.lora_rank=0\)"):
        check_adapter_dir(str(plain))


def _edited(src, dst, config=None, tensors=None, drop=()):
    """A copy of adapter ``src`` at ``dst`` with config keys set, tensors added and tensors dropped."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    weights = {k: v for k, v in load_file(dst / "adapter_model.safetensors").items() if k not in drop}
    save_file({**weights, **(tensors or {})}, dst / "adapter_model.safetensors")
    return str(dst)


def test_refusals_are_one_line(family, tmp_path):
    _, ours, src = peft_adapter(family, "plain", tmp_path)
    prefix = "base_model.model.model.layers.0."
    norm = prefix + "input_layernorm"
    cases = [
        (ConfigError, "use_dora=True; DoRA", dict(config={"use_dora": True})),
        (ConfigError, "bias='lora_only'", dict(config={"bias": "lora_only"})),
        (ConfigError, "modules_to_save", dict(config={"modules_to_save": ["lm_head"]})),
        (ConfigError, "peft_type 'IA3'", dict(config={"peft_type": "IA3"})),
        (ConfigError, "embedding adapter", dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A": 1})),
        (ConfigError, "input_layernorm is no linear", dict(tensors={f"{norm}.lora_{x}.weight": 1 for x in "AB"})),
        (CheckpointError, "v_proj has lora_A but no lora_B", dict(drop=(prefix + "self_attn.v_proj.lora_B.weight",))),
    ]
    seen = []
    for i, (kind, match, edit) in enumerate(cases):
        edit["tensors"] = {k: torch.ones(4, 32) * v for k, v in (edit.get("tensors") or {}).items()}
        with pytest.raises(kind, match=match) as e:
            load_adapter(_edited(src, tmp_path / f"e{i}", **edit), ours.cfg, "x")
        seen.append(str(e.value))
    with pytest.raises(CheckpointError, match=r"down_proj has lora_A \[4, 48\] .* needs \[4, 64\]") as e:
        load_adapter(str(src), dataclasses.replace(ours.cfg, ffn_hidden=64), "x")  # another model's shapes
    seen.append(str(e.value))
    binary = shutil.copytree(src, tmp_path / "bin")
    os.replace(binary / "adapter_model.safetensors", binary / "adapter_model.bin")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, match in ((binary, "adapter_model.bin only; convert it to safetensors"), (empty, "neither a PEFT")):
        with pytest.raises(CheckpointError, match=match) as e:
            check_adapter_dir(str(path))
        seen.append(str(e.value))
    assert all("\n" not in line for line in seen)
    named = shutil.copytree(src, tmp_path / "named")  # the adapter's name inside the keys, as some writers put it
    tensors = load_file(named / "adapter_model.safetensors")
    save_file(
        {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}, named / "adapter_model.safetensors"
    )
    plain, renamed = load_adapter(str(src), ours.cfg, "x").weights, load_adapter(str(named), ours.cfg, "x").weights
    assert plain.keys() == renamed.keys() and all(torch.equal(plain[k][1], renamed[k][1]) for k in plain)


def test_a_lora_run_initializes_a_run_merged_or_with_its_adapters(lora_run):
    """``train.init_from`` a LoRA run: into a run without adapters each adapter is folded into its weight, into a run
    with the same adapters they carry on, into one with other targets a one-line refusal. Its one-process export
    (``checkpoint export --format trickles``) keeps the adapters."""
    from trickles.adapters import LoRASettings, apply_lora
    from trickles.models.transformer import Transformer
    from trickles.train.export import export_checkpoint
    from trickles.train.load import load_for_inference
    from trickles.train.trainer_state import init_source

    tmp, path = lora_run
    single = export_checkpoint(path, str(tmp / "single"), "trickles")
    merged, _, _ = load_for_inference(path)
    assert all(
        torch.equal(a, b)
        for a, b in zip(load_for_inference(single)[0].state_dict().values(), merged.state_dict().values())
    )
    kept, _, _ = load_for_inference(path, merge_adapters=False)
    for fused in (False, True):
        with torch.device("meta"):
            plain = Transformer(dataclasses.replace(merged.cfg, fused_proj=fused))
        init = init_source(path, plain)
        want = fusion.fuse_state(plain.cfg, fusion.split_state(merged.cfg, merged.state_dict()))
        for name, p in plain.named_parameters():
            torch.testing.assert_close(init(name, p), want[name], rtol=0, atol=0)
    with torch.device("meta"):
        adapted = Transformer(merged.cfg)
        apply_lora(adapted, LoRASettings(rank=4, alpha=6.0))
    init = init_source(path, adapted)
    for name, p in kept.named_parameters():
        assert torch.equal(init(name, dict(adapted.named_parameters())[name]), p.detach()), name
    with torch.device("meta"):
        other = Transformer(merged.cfg)
        apply_lora(other, LoRASettings(rank=4, alpha=6.0, targets=("q_proj",)))
    with pytest.raises(CheckpointError, match=r"does not fit this model: missing \[\], unexpected \[.*lora_A") as e:
        init_source(path, other)
    assert "\n" not in str(e.value)
