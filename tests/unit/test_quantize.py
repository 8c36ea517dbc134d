"""int8 quantization's math: the scales, the half-step bound, and the true int8 matmul against its derived bound."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trickles.compress.qat import apply_qat, fake_quant_rows
from trickles.compress.quantize import (
    Int8Linear,
    dequantize,
    error_bound,
    int8_matmul,
    int_mm_path,
    quantize_tokens,
    quantize_weight,
)


def _operands(m=9, k=96, n=40, seed=0):
    """Activations with an outlier channel and weights whose rows differ in size (what per-row scales are for)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 30.0
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    return x, w


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_weights_round_within_half_a_step(granularity):
    _, w = _operands()
    q, s = quantize_weight(w, granularity)
    assert q.dtype == torch.int8 and s.shape == (w.shape[0],) and int(q.abs().max()) == 127
    err = (w - dequantize(q, s)).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 1e-6)).all())
    if granularity == "tensor":
        assert torch.equal(s, s[:1].expand_as(s))
    assert torch.equal(quantize_weight(torch.zeros(3, 4))[1], torch.ones(3))  # an all-zero row: scale 1, codes 0


def test_per_row_reconstructs_better_than_per_tensor():
    _, w = _operands()
    row = (w - dequantize(*quantize_weight(w, "row"))).pow(2).mean()
    tensor = (w - dequantize(*quantize_weight(w, "tensor"))).pow(2).mean()
    assert (
        row < tensor / 5
    )  # rows spanning two decades (measured: 8x): per-tensor steps are far too coarse for the small rows


def test_true_int8_matmul_within_the_bound_the_scales_imply():
    x, w = _operands()
    q, s_w = quantize_weight(w)
    layer = Int8Linear(w.shape[1], w.shape[0], bias=False, mode="full")
    layer.weight.copy_(q)
    layer.weight_scale.copy_(s_w)
    y = layer(x)
    assert layer.path == "int_mm"
    xq, s_x = quantize_tokens(x)
    # the integer product is exact: the same as int64 arithmetic
    acc = int8_matmul(xq, q.t().contiguous(), "int_mm")
    assert torch.equal(acc.long(), xq.long() @ q.long().t())
    # against the float product: |err| <= sum_k |x_k| s_w/2 + |w_k| s_x/2 + s_x s_w/4, plus fp32 rounding of the rescale
    exact = x.double() @ w.double().t()
    err = (y.double() - exact).abs()
    bound = error_bound(x, w, s_x, s_w).double() + 1e-5 * (x.abs() @ w.abs().t()).double()
    assert bool((err <= bound).all()), float((err / bound).max())
    # the bound is tight enough to mean something: the error uses a visible share of it somewhere ...
    assert float((err / bound).max()) > 0.05
    # ... and its activation term is needed: the weights' rounding alone does not explain the error
    weights_only = x.abs().sum(1, keepdim=True).double() * s_w[None, :].double() / 2
    assert bool((err > weights_only).any())
    # against the weight-dequantized float reference: only the activations' rounding, |err| <= s_x/2 sum_k |s_w q_jk|
    ref = x.double() @ dequantize(q, s_w).double().t()
    bound_w = (
        s_x[:, None].double() / 2 * dequantize(q, s_w).abs().sum(1)[None, :].double()
        + 1e-5 * (x.abs() @ w.abs().t()).double()
    )
    assert bool(((y.double() - ref).abs() <= bound_w).all())


@pytest.mark.parametrize("path", ["fp32_exact", "fp64_exact"])
def test_fallback_products_are_exact(path):
    x, w = _operands()
    q, _ = quantize_weight(w)
    xq, _ = quantize_tokens(x)
    assert torch.equal(int8_matmul(xq, q.t().contiguous(), path), torch._int_mm(xq, q.t().contiguous()))


def test_int_mm_paths():
    assert int_mm_path(1, 64, 64, torch.device("cpu")) == "int_mm"
    assert int_mm_path(4, 64, 64, torch.device("cuda")) == "int_mm_padded"
    assert int_mm_path(32, 64, 64, torch.device("cuda")) == "int_mm"
    assert int_mm_path(32, 60, 64, torch.device("cuda")) == "fp32_exact"  # k not a multiple of 8
    assert int_mm_path(32, 2001, 64, torch.device("cuda")) == "fp64_exact"  # 2001 * 127^2 >= 2^24


def test_weight_only_equals_the_dequantized_linear():
    x, w = _operands()
    lin = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = Int8Linear.from_float(lin)
    ref = F.linear(x, dequantize(layer.weight, layer.weight_scale), lin.bias).detach()
    assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    layer.mode = "full"
    assert (layer(x) - ref).abs().max() > 0  # full mode quantizes the activations too


def test_fake_quant_is_the_int8_grid_with_straight_through_gradients():
    _, w = _operands()
    w.requires_grad_(True)
    fq = fake_quant_rows(w)
    q, s = quantize_weight(w)
    assert torch.allclose(fq, dequantize(q, s), rtol=0, atol=1e-7)
    fq.backward(torch.arange(w.numel(), dtype=torch.float32).view_as(w))
    assert torch.equal(w.grad, torch.arange(w.numel(), dtype=torch.float32).view_as(w))


def test_apply_qat_fake_quantizes_the_projections_quantization_replaces_and_names_them():
    """``apply_qat`` returns the names of the projections it switched to fake quantization: those ``trickles quantize``
    replaces (every block's attention and MLP projections and the untied output), each now computing with its
    weight rounded to the int8 grid."""
    from trickles.compress.quantize import quantized_names
    from trickles.models import ModelConfig, apply_preset, build_model

    cfg = dataclasses.replace(apply_preset(ModelConfig(), "tiny"), vocab_size=64, max_seq_len=16)
    model = build_model(cfg, seed=0)
    names = apply_qat(model)
    assert names == quantized_names(model) and "layers.1.mlp.down_proj" in names and "output" in names
    for name in names:
        mod = model.get_submodule(name)
        x = torch.randn(3, mod.weight.shape[1], generator=torch.Generator().manual_seed(0))
        assert mod.qat and not torch.equal(mod(x), F.linear(x, mod.weight))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_apply_qat_unfuses_the_loss_only_where_it_fake_quantizes_the_output(tied):
    """An untied output layer is fake-quantized, so the loss must come from its (rounded) logits: the fused loss, which
    reads the float weight, is switched off. A tied one is the embedding, not quantized: the fused loss stays."""
    from trickles.models import ModelConfig, apply_preset, build_model

    cfg = dataclasses.replace(
        apply_preset(ModelConfig(), "tiny"), vocab_size=64, max_seq_len=16, tie_embeddings=tied, fused_loss=True
    )
    model = build_model(cfg, seed=0)
    assert model.loss.fused
    names = apply_qat(model)
    assert ("output" in names) is (not tied) and model.loss.fused is tied
