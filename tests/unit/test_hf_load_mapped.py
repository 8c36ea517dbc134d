"""``load_hf`` maps a parameter stored as is in the asked dtype instead of copying it (as transformers'
``from_pretrained`` does); the mapping is private: training the model never writes to the files."""

import hashlib
import sys

import pytest
import torch

from trickles.models import ModelConfig, build_model
from trickles.models.hf import load_hf, save_hf

CFG = ModelConfig(
    flavor="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=96, max_seq_len=16
)


def mapped_files() -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of this process's mappings of safetensors files."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if parts[-1].endswith(".safetensors"):
                start, end = (int(a, 16) for a in parts[0].split("-"))
                out.append((start, end, parts[-1]))
    return out


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_load_maps_the_files_privately_and_copies_what_it_converts(tmp_path):
    source = build_model(CFG, seed=0)
    save_hf(source, tmp_path / "hf", dtype=torch.float32)
    before = digest(tmp_path / "hf" / "model.safetensors")
    model = load_hf(tmp_path / "hf")
    maps = mapped_files()
    for name, p in model.named_parameters():
        assert torch.equal(p, source.state_dict()[name])
        assert any(a <= p.data_ptr() < b for a, b, _ in maps), f"{name} was copied, not mapped"
    # an optimizer step writes into the parameters: their pages are copied on write, the file keeps its bytes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert digest(tmp_path / "hf" / "model.safetensors") == before
    again = load_hf(tmp_path / "hf")
    assert torch.equal(again.embed.weight, source.embed.weight)
    assert torch.equal(model.embed.weight, source.embed.weight + 1)
    # converted on the way in: copied into the model's own memory
    half = load_hf(tmp_path / "hf", dtype=torch.bfloat16)
    maps = mapped_files()
    assert not any(a <= p.data_ptr() < b for p in half.parameters() for a, b, _ in maps)
    assert torch.equal(half.embed.weight, source.embed.weight.bfloat16())
