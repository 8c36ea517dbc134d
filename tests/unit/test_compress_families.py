"""int8 quantization and pruning of the families' layers: biases, q/k norms (per head and full width), norms after
the branches (post, sandwich) and sliding windows, each against an expectation computed by hand."""

import copy

import pytest
import torch
import torch.nn.functional as F

from trickles.compress.prune import Plan, prune_model
from trickles.compress.quantize import Int8Linear, quantize_model, set_mode
from trickles.models import ModelConfig, build_model

VOCAB, SEQ, WINDOW = 96, 12, 4
#: every new piece at once: biases on every projection, per-head q/k norms, sandwich norms, a per-layer window
RICH = dict(
    qkv_bias=True,
    o_bias=True,
    mlp_bias=True,
    qk_norm="head",
    norm_placement="sandwich",
    sliding_window=WINDOW,
    window_layers=[True, False, True],
)
#: OLMo 2's full-width q/k norm and post norms, every layer sliding
FULL = dict(qkv_bias=True, o_bias=True, qk_norm="full", norm_placement="post", sliding_window=WINDOW)


def tiny(**kw) -> ModelConfig:
    base = dict(
        flavor="llama",
        n_layers=3,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=96,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        fused_proj=False,
        kernels="torch",
    )
    return ModelConfig(**{**base, **kw})


def noisy(cfg: ModelConfig, seed: int = 0):
    """A model whose norms and biases are far from their initial ones and zeros."""
    model = build_model(cfg, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name or "bias" in name else 0.05))
    return model.eval()


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


# ---- int8 ----------------------------------------------------------------------------------------


def by_hand(w: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 of ``w``, dequantized: ``round(w / s) s`` with ``s = max |row| / 127``."""
    s = w.abs().amax(dim=1, keepdim=True) / 127
    return torch.round(w / s).clamp(-127, 127) * s


@pytest.mark.parametrize("features", [RICH, FULL], ids=["bias-headnorm-sandwich-window", "fullnorm-post-window"])
def test_int8_quantizes_the_projections_and_keeps_biases_and_norms_float(features):
    model = noisy(tiny(**features))
    reference = copy.deepcopy(model)  # the float model with each projection's weight replaced by its int8 value
    with torch.no_grad():
        for block in reference.layers.values():
            for part in (block.attn, block.mlp):
                for name, child in part.named_children():
                    if name.endswith("_proj"):
                        child.weight.copy_(by_hand(child.weight))
        reference.output.weight.copy_(by_hand(reference.output.weight))
    x = tokens()
    with torch.no_grad():
        want, float_logits = reference(x), model(x)
    names = quantize_model(model)
    assert len(names) == 3 * 7 + 1 and names[-1] == "output"  # q, k, v, o, gate, up, down of each block; the head
    for key, block in model.layers.items():
        old = reference.layers[key]
        for part, old_part in ((block.attn, old.attn), (block.mlp, old.mlp)):
            for name, child in part.named_children():
                if name.endswith("_proj"):
                    assert isinstance(child, Int8Linear) and child.weight.dtype == torch.int8
                    # the bias stays float, exactly the float layer's
                    bias = getattr(old_part, name).bias
                    assert (child.bias is None) == (bias is None)
                    if bias is not None:
                        assert child.bias.dtype == torch.float32 and torch.equal(child.bias, bias)
        # q/k norms and the block's norms are untouched float modules
        for norm in ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"):
            assert [p.dtype for p in getattr(block, norm).parameters()] == [
                torch.float32 for _ in getattr(old, norm).parameters()
            ]
            for a, b in zip(getattr(block, norm).parameters(), getattr(old, norm).parameters()):
                assert torch.equal(a, b)
        assert torch.equal(block.attn.q_norm.weight, old.attn.q_norm.weight)
        assert torch.equal(block.attn.k_norm.weight, old.attn.k_norm.weight)
    with torch.no_grad():
        weight_only = model(x)
        set_mode(model, "full")
        full = model(x)
    # weight-only int8 is the dequantized float model up to rounding; both are close to the float logits
    assert rel(weight_only, want) < 1e-5
    assert rel(weight_only, float_logits) < 2e-2
    assert rel(full, float_logits) < 5e-2


# ---- pruning -------------------------------------------------------------------------------------


def kill(model, groups: dict[int, int], channels: dict[int, list[int]]) -> None:
    """Zeroes the o_proj columns of key/value group ``groups[l]``'s query heads and the down_proj columns
    ``channels[l]`` of each layer ``l``: those units then add nothing to the residual stream."""
    cfg = model.cfg
    rep, d = cfg.n_heads // cfg.kv_heads, cfg.head_dim
    with torch.no_grad():
        for layer, g in groups.items():
            block = model.layers[str(layer)]
            block.attn.o_proj.weight[:, g * rep * d : (g + 1) * rep * d] = 0
            block.mlp.down_proj.weight[:, channels[layer]] = 0


def test_pruned_heads_take_their_biases_and_the_shared_per_head_norm_stays():
    """Biases everywhere, per-head q/k norms, sandwich norms, a per-layer window longer sequences cross: the pruned
    model is the original with the pruned heads' and channels' output weights zeroed."""
    cfg = tiny(**RICH)
    model = noisy(cfg)
    dead_group = {0: 1, 1: 0, 2: 1}
    dead = {layer: list(range(layer, cfg.ffn_dim, 4)) for layer in range(3)}
    kill(model, dead_group, dead)
    p = Plan(
        [0, 1, 2],
        {layer: [1 - g] for layer, g in dead_group.items()},
        {layer: [c for c in range(cfg.ffn_dim) if c not in dead[layer]] for layer in range(3)},
    )
    small = prune_model(model, p)
    assert (small.cfg.n_heads, small.cfg.kv_heads, small.cfg.ffn_hidden) == (2, 1, 72)
    assert small.cfg.window_layers == [True, False, True]
    d = cfg.head_dim
    for layer, g in dead_group.items():
        new, old = small.layers[str(layer)].attn, model.layers[str(layer)].attn
        keep = 1 - g
        assert torch.equal(new.q_proj.bias, old.q_proj.bias[keep * 2 * d : (keep + 1) * 2 * d])
        assert torch.equal(new.k_proj.bias, old.k_proj.bias[keep * d : (keep + 1) * d])
        assert torch.equal(new.v_proj.bias, old.v_proj.bias[keep * d : (keep + 1) * d])
        assert torch.equal(new.o_proj.bias, old.o_proj.bias)
        assert torch.equal(new.q_norm.weight, old.q_norm.weight)  # [head_dim], shared by the heads: kept whole
        assert torch.equal(new.k_norm.weight, old.k_norm.weight)
        mlp, old_mlp = small.layers[str(layer)].mlp, model.layers[str(layer)].mlp
        assert torch.equal(mlp.gate_proj.bias, old_mlp.gate_proj.bias[p.channels[layer]])
        assert torch.equal(mlp.down_proj.bias, old_mlp.down_proj.bias)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def test_a_full_width_norm_prunes_to_the_attention_of_the_kept_heads_computed_by_hand():
    """OLMo 2's q/k norm over the kept heads' features with their slice of the weights, biases sliced with their
    heads, a sliding window: the pruned block's attention against the formula written out."""
    cfg = tiny(**FULL)
    model = noisy(cfg)
    keep = {0: 1, 1: 0, 2: 1}
    p = Plan([0, 1, 2], {layer: [g] for layer, g in keep.items()}, {layer: list(range(cfg.ffn_dim)) for layer in keep})
    small = prune_model(model, p)
    d, eps = cfg.head_dim, cfg.norm_eps
    x = torch.randn(2, SEQ, cfg.d_model, generator=torch.Generator().manual_seed(3))
    cos, sin = model.rope(0, SEQ)
    pos = torch.arange(SEQ)
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < WINDOW)
    for layer, g in keep.items():
        old = model.layers[str(layer)].attn
        qi, kv = slice(g * 2 * d, (g + 1) * 2 * d), slice(g * d, (g + 1) * d)
        with torch.no_grad():
            q = F.linear(x, old.q_proj.weight[qi], old.q_proj.bias[qi])
            k = F.linear(x, old.k_proj.weight[kv], old.k_proj.bias[kv])
            v = F.linear(x, old.v_proj.weight[kv], old.v_proj.bias[kv])
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * old.q_norm.weight[qi]
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * old.k_norm.weight[kv]
            q = rotate(q.view(2, SEQ, 2, d).transpose(1, 2), cos, sin)  # the kept group's two query heads
            k = rotate(k.view(2, SEQ, 1, d).transpose(1, 2), cos, sin)
            scores = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~mask, float("-inf"))
            heads = (scores.softmax(-1) @ v.view(2, SEQ, 1, d).transpose(1, 2)).transpose(1, 2).reshape(2, SEQ, -1)
            want = F.linear(heads, old.o_proj.weight[:, qi], old.o_proj.bias)
            got = small.layers[str(layer)].attn(x, small.rope(0, SEQ))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("local_theta", [None, 1000.0], ids=["one-rope", "local-rope"])
def test_pruning_a_block_keeps_the_other_layers_windows(local_theta):
    """A block whose branches add nothing (output weights and biases zero) removed: the remaining layers keep their
    own window (and, with a local rotary base, their own rotary tables), so the logits are the original's."""
    cfg = tiny(**RICH, **({} if local_theta is None else {"rope_local_theta": local_theta}))
    model = noisy(cfg)
    with torch.no_grad():
        block = model.layers["0"]
        for proj in (block.attn.o_proj, block.mlp.down_proj):
            proj.weight.zero_()
            proj.bias.zero_()
    p = Plan([1, 2], {1: [0, 1], 2: [0, 1]}, {1: list(range(cfg.ffn_dim)), 2: list(range(cfg.ffn_dim))})
    small = prune_model(model, p)
    assert small.cfg.n_layers == 2 and small.cfg.window_layers == [False, True]
    assert [b.attn.window for b in small.layers.values()] == [None, WINDOW]
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), rtol=1e-5, atol=1e-5)
