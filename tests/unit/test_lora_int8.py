"""LoRA on a frozen base held in per-row int8 (``train.lora_base = "int8"``, trickles/adapters/int8_base.py): the
module's forward and input gradient are those of the dequantized weight, with nothing kept for a weight gradient; a
run's codes are the quantizer's codes of the float run's weights and stay bitwise unchanged; checkpoints hold them
once and resume exactly; dp2 (DDP and ZeRO-2) trains like one process; exports (PEFT: the adapters alone; Hugging
Face: merged into the dequantized weight); the layouts not built refuse in one line."""

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config
from safetensors.torch import load_file
from torch import nn

from trickles.adapters.int8_base import hold_int8
from trickles.adapters.lora import LoRALinear, LoRASettings, apply_lora
from trickles.compress.quantize import dequantize, quantize_weight
from trickles.errors import ConfigError
from trickles.models.transformer import initial_value
from trickles.testing import run_ranks
from trickles.train.trainer import Trainer

INT8 = ("train.lora_rank=4", "train.lora_alpha=8", "train.lora_base=int8")


def test_module_computes_the_dequantized_weight_and_keeps_no_weight_input():
    torch.manual_seed(0)
    base = nn.Linear(64, 48)
    w = base.weight.detach().clone()
    lora = LoRALinear(base, 4, 2.0, 0.0)
    nn.init.normal_(lora.lora_B.weight)
    hold_int8(lora)
    codes, scales = quantize_weight(w)
    assert lora.weight.dtype == torch.int8 and torch.equal(lora.weight, codes)
    assert torch.equal(lora.weight_scale, scales) and not lora.weight.requires_grad
    assert (w - dequantize(codes, scales)).abs().le(scales[:, None] / 2 + 1e-7).all()
    dense = dequantize(codes, scales)
    x = torch.randn(5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    saved = []
    state = {t.untyped_storage().data_ptr() for t in lora.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in state:
            saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = lora(x)
    a, b = lora.lora_A.weight, lora.lora_B.weight
    ref = F.linear(x_ref, dense, lora.bias) + 2.0 * x_ref @ a.detach().t() @ b.detach().t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # the adapter's input x and its rank-4 product; nothing for the frozen base (not x again, not a widened weight)
    assert sorted(saved) == [5 * 4 * 4, 5 * 64 * 4]
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert lora.weight.grad is None and lora.weight_scale.grad is None and lora.bias.grad is None
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(lora.merged_weight(), dense + 2.0 * b.detach() @ a.detach())
    assert lora.merged_weight().dtype == torch.float32


def test_bad_base_is_one_line():
    with pytest.raises(ConfigError, match="train.lora_base must be one of"):
        LoRASettings(4, 8.0, base="int4").check()


@pytest.mark.parametrize(
    "overrides,match",
    [
        (("parallel.zero=3",), "not built with train.lora_base=int8 and ZeRO-3 yet; use parallel.zero=2"),
        (("parallel.tp=2",), "not built with train.lora_base=int8 and parallel.tp=2"),
        (("train.lora_base=int4",), "train.lora_base must be one of"),
        (("train.lora_rank=0",), "train.lora_base=int8 sets the type of LoRA's frozen base"),
    ],
    ids=["zero3", "tp2", "bad", "no-rank"],
)
def test_layouts_not_built_refuse_in_one_line(tmp_path, overrides, match):
    cfg = tiny_config(str(tmp_path), *INT8, *overrides)
    with pytest.raises(ConfigError, match=match) as e:
        cfg.validate(2)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenized corpus for every run of the module."""
    return f"data.cache_dir={tmp_path_factory.mktemp('int8-cache')}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache):
    return _steps(str(tmp_path_factory.mktemp("int8-one")), (cache,), 1)


def _steps(tmp, overrides, world, steps=3):
    # (Adam's eps raised: a LoRA A starts with a zero gradient (B = 0), and with eps 1e-8 an entry whose gradient is
    # rounding noise moves by +-lr on the sign of that noise, which the reduction order of each layout decides)
    cfg = tiny_config(tmp, *INT8, *overrides, "train.eps=1e-6", steps=steps)
    tr = Trainer(cfg, cfg.validate(world).build(torch.device("cpu")), quiet=True)
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    getattr(tr.engine, "wait_for_parameters", lambda: None)()  # ZeRO-1/2: the last update's all-gathers in flight
    state = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    return losses, state


def test_one_process_codes_checkpoint_resume_and_exports(tmp_path, cache):
    from trickles.train.export import export_checkpoint
    from trickles.train.pieces import PieceReader

    cfg = tiny_config(str(tmp_path), *INT8, cache, steps=2)
    tr = Trainer(cfg, cfg.validate(1).build(torch.device("cpu")), quiet=True)
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    q = "layers.1.attn.q_proj"
    full = initial_value(tr.model_cfg, f"{q}.weight", (64, 64), cfg.train.seed)
    codes, scales = quantize_weight(full)  # the float run's initial weight, quantized per row
    assert torch.equal(frozen[f"{q}.weight"], codes) and torch.equal(frozen[f"{q}.weight_scale"], scales)
    assert sum(n.endswith(".weight_scale") for n in frozen) == 2 * 7
    tr.train_step()
    path = tr.save_checkpoint()
    later = tr.train_step()["loss"]
    assert all(torch.equal(frozen[n], p) for n, p in tr.model.named_parameters() if n in frozen)
    reader = PieceReader(path, "model")
    assert reader.read(f"{q}.weight").dtype == torch.int8 and torch.equal(reader.read(f"{q}.weight"), codes)
    assert not [k for k in PieceReader(path, "optimizer").keys() if "weight_scale" in k or ".q_proj.weight" in k]

    again = Trainer(cfg, cfg.validate(1).build(torch.device("cpu")), quiet=True)
    again.load_checkpoint(path)
    assert again.train_step()["loss"] == later

    peft = export_checkpoint(path, str(tmp_path / "peft"), "peft")
    adapters = load_file(f"{peft}/adapter_model.safetensors")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    hf = export_checkpoint(path, str(tmp_path / "hf"), "hf")
    merged = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        merged.update(load_file(str(f)))
    ckpt = {k: reader.read(k) for k in (f"{q}.weight", f"{q}.weight_scale", f"{q}.lora_A.weight", f"{q}.lora_B.weight")}
    dense = dequantize(ckpt[f"{q}.weight"], ckpt[f"{q}.weight_scale"])
    want = dense + 2.0 * ckpt[f"{q}.lora_B.weight"] @ ckpt[f"{q}.lora_A.weight"]
    torch.testing.assert_close(merged["model.layers.1.self_attn.q_proj.weight"], want)
    assert hf and not any("weight_scale" in k for k in merged)


@pytest.mark.parametrize("zero", [0, 2])
def test_dp2_matches_one_process(tmp_path, zero, cache, one_process):
    losses, state = one_process
    for got, got_state in run_ranks(2, _steps, str(tmp_path / "two"), (cache, f"parallel.zero={zero}"), 2):
        assert got == pytest.approx(losses, rel=1e-5)
        for n, p in state.items():
            if p.dtype == torch.int8 or n.endswith("weight_scale"):
                assert torch.equal(got_state[n], p), n
            else:
                torch.testing.assert_close(got_state[n], p, rtol=1e-4, atol=1e-5)


def test_apply_lora_holds_every_adapted_weight_in_int8():
    from trickles.models.config import ModelConfig
    from trickles.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(
            ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16, ffn_hidden=48)
        )
    apply_lora(model, LoRASettings(2, 4.0, targets=("q_proj", "down_proj"), base="int8"))
    int8 = sorted(n for n, p in model.named_parameters() if p.dtype == torch.int8)
    assert int8 == [f"layers.{i}.{m}.weight" for i in (0, 1) for m in ("attn.q_proj", "mlp.down_proj")]
    assert model.layers["0"].attn.k_proj.weight.dtype == torch.float32
