"""Fused q/k/v and gate/up projections on one process: the layout, the checkpoint reader's part names, Hugging Face
import and export, decoding with a KV cache, the activation bytes, and the refusal under tensor parallelism.
(Layouts and resuming across fusion: tests/distributed/test_fused_proj.py; with the Triton kernels:
tests/unit/test_kernels.py.)"""

import dataclasses

import pytest
import torch

from trickles.models import fused
from trickles.models.config import ModelConfig
from trickles.models.generate import generate
from trickles.models.transformer import build_model
from trickles.train import checkpoint as ckpt
from trickles.train.pieces import PieceReader, save_pieces

CFG = ModelConfig(
    flavor="llama",
    n_layers=2,
    d_model=48,
    n_heads=6,
    n_kv_heads=2,
    ffn_hidden=40,
    vocab_size=101,
    max_seq_len=16,
    fused_proj=False,
)


def _pair(cfg=CFG, seed=3):
    return build_model(cfg, seed), build_model(dataclasses.replace(cfg, fused_proj=True), seed)


def test_layout_interleaves_whole_groups():
    """q/k/v rows grouped by key/value head (3 query heads, then its key and value head), gate/up rows by channel;
    fuse and split are inverses, and any split of the rows by a divisor of the group count holds whole groups."""
    layout = fused.layout_of(CFG, "layers.0.attn.qkv_proj.weight")
    assert (layout.sizes, layout.groups) == ((3 * 8, 8, 8), 2)
    q, k, v = (torch.arange(n * 5, dtype=torch.float32).view(n, 5) + 1000 * i for i, n in enumerate((48, 16, 16)))
    w = layout.fuse([q, k, v])
    assert torch.equal(w[:24], q[:24]) and torch.equal(w[24:32], k[:8]) and torch.equal(w[32:40], v[:8])
    assert torch.equal(w[40:64], q[24:]) and all(torch.equal(a, b) for a, b in zip(layout.split(w), (q, k, v)))
    gu = fused.layout_of(CFG, "layers.1.mlp.gate_up_proj.weight")
    g, u = torch.randn(40, 3), torch.randn(40, 3)
    assert torch.equal(gu.fuse([g, u]).view(40, 2, 3)[:, 1], u)
    assert fused.layout_of(CFG, "layers.0.attn.o_proj.weight") is None


def test_fused_model_computes_the_unfused_function_and_decodes_alike():
    """The same initial weights (each part by its own name), logits to 1e-6, and greedy decoding through the KV cache
    gives the same tokens; the cache holds the model's key/value heads."""
    plain, fused_model = _pair()
    assert {n for n, _ in plain.named_parameters()} == set(
        fused.split_state(fused_model.cfg, dict(fused_model.named_parameters()))
    )
    split = fused.split_state(fused_model.cfg, fused_model.state_dict())
    assert all(torch.equal(split[n], t) for n, t in plain.state_dict().items())
    x = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fused_model(x), plain(x), rtol=1e-6, atol=1e-6)
    assert fused_model.new_cache(2, 12).shape == plain.new_cache(2, 12).shape == (2, 2, 12, 8)
    assert torch.equal(generate(fused_model, x, 5, temperature=0), generate(plain, x, 5, temperature=0))


def _write(model, root):
    root.mkdir()
    save_pieces(ckpt.model_pieces(model), str(root / "model-rank00000.safetensors"))
    return PieceReader(str(root), "model")


def test_checkpoint_reader_names_parts_and_reads_any_region(tmp_path):
    """A fused model's checkpoint lists the parts' names only; any block or flat range of a part read from it equals
    the part's; a fused tensor read from an unfused checkpoint equals the fused one, block and flat range alike."""
    plain, fused_model = _pair()
    r_fused, r_plain = _write(fused_model, tmp_path / "f"), _write(plain, tmp_path / "p")
    assert r_fused.keys() == r_plain.keys() and not any("qkv" in k or "gate_up" in k for k in r_fused.keys())
    parts = fused.split_state(fused_model.cfg, fused_model.state_dict())
    k = "layers.1.attn.k_proj.weight"
    assert r_fused.global_shape(k) == (16, 48)
    assert torch.equal(r_fused.read(k, ((3, 5), (11, 20))), parts[k][3:14, 5:25])
    assert torch.equal(
        r_fused.read("layers.0.mlp.up_proj.weight", ((7, 0), (9, 48)), flat_range=(13, 300)),
        parts["layers.0.mlp.up_proj.weight"][7:16].reshape(-1)[13:300],
    )
    name = "layers.0.attn.qkv_proj.weight"
    layout = fused_model.layers["0"].attn.qkv_proj.weight.fused_layout
    whole = fused_model.state_dict()[name]
    assert r_plain.holds(name, layout) and not r_plain.holds(name) and r_plain.global_shape(name, layout) == (80, 48)
    assert torch.equal(r_plain.read(name, layout=layout), whole)
    assert torch.equal(
        r_plain.read(name, ((37, 2), (30, 40)), (5, 1100), layout), whole[37:67, 2:42].reshape(-1)[5:1100]
    )
    again = build_model(dataclasses.replace(CFG, fused_proj=True), seed=9)
    ckpt.load_model_state(again, r_plain, "plain")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fused_model.state_dict().values()))


@pytest.mark.parametrize("flavor", ["llama", "gpt2"])
def test_hugging_face_export_and_import_through_the_parts(tmp_path, flavor):
    """A fused model exports the parts Hugging Face names (transformers gives its logits), and imports fused or not."""
    transformers = pytest.importorskip("transformers")
    from trickles.models.hf import load_hf, save_hf

    cfg = dataclasses.replace(CFG, flavor=flavor, n_kv_heads=None if flavor == "gpt2" else 2)
    _, model = _pair(cfg)
    save_hf(model, tmp_path / "hf")
    x = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = model(x)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    torch.testing.assert_close(hf(x).logits, ref, rtol=1e-4, atol=1e-4)
    for setting in (True, False):
        back = load_hf(tmp_path / "hf", fused_proj=setting)
        assert back.cfg.fuses_projections is setting
        torch.testing.assert_close(back(x), ref, rtol=1e-6, atol=1e-6)


def test_activation_bytes_are_the_unfused_models():
    """The split heads are copies and the fused output is not kept: each layer saves exactly the unfused layer's bytes,
    which the memory formulas give."""
    from trickles.memory.activations import ActivationMeter, activation_bytes

    x = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    per_layer = []
    for model in _pair():
        with ActivationMeter(model) as meter:
            loss = model(x, target=x)
        loss.backward()
        per_layer.append({k: v for k, v in meter.per_layer.items() if k.startswith("layers.")})
    assert per_layer[0] == per_layer[1]
    assert per_layer[1]["layers.1"] == activation_bytes(CFG, 2, 16)["layer"]


def test_fused_projections_need_tp_to_divide_the_key_value_heads():
    from trickles.config import Config
    from trickles.errors import ConfigError

    with pytest.raises(ConfigError, match="model.fused_proj=false or make n_kv_heads a multiple of parallel.tp"):
        Config.load(
            None, ["model.preset=tiny", "model.n_kv_heads=1", "model.fused_proj=true", "parallel.tp=2"]
        ).validate(2)
    Config.load(None, ["model.preset=tiny", "model.fused_proj=true", "parallel.tp=2"]).validate(2)
