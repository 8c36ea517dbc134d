"""The mixture-of-experts layer on one device: against a naive loop over tokens and experts, the router's
gradient, capacity on hand-made routes, the auxiliary losses' gradients, config checks and FLOPs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trickles.errors import ConfigError
from trickles.models.config import ModelConfig
from trickles.models.moe import MoE, MoEStats, aux_losses, load_fraction, route
from trickles.models.transformer import build_model, initial_value
from trickles.train.flops import matmul_params


def _cfg(**kw):
    base = dict(
        n_layers=2,
        d_model=12,
        n_heads=2,
        n_kv_heads=None,
        ffn_hidden=20,
        vocab_size=32,
        max_seq_len=16,
        moe_experts=4,
        moe_top_k=2,
        moe_ffn_hidden=10,
    )
    base.update(kw)
    return ModelConfig(**base)


def _layer(cfg, dtype=torch.float64, seed=0):
    layer = MoE(cfg, 0, MoEStats()).to(dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(initial_value(cfg, "layers.0.mlp." + name, tuple(p.shape), seed) * 10)  # larger: routes differ
    return layer


def _naive(layer, x):
    """Token by token, expert by expert, capacity by the docstring's rule (per sequence, first choices first)."""
    cfg_k, e_n, cf = layer.top_k, layer.n_experts, layer.capacity_factor
    b, t, _ = x.shape
    out = torch.zeros_like(x)
    for s in range(b):
        probs = [torch.softmax(layer.router.weight.double() @ x[s, i].double(), -1) for i in range(t)]
        choices = [torch.topk(p, cfg_k).indices.tolist() for p in probs]
        cap = math.ceil(cf * cfg_k * t / e_n) if cf > 0 else None
        taken = [0] * e_n
        keep = {}
        for j in range(cfg_k):
            for i in range(t):
                e = choices[i][j]
                keep[i, j] = cap is None or taken[e] < cap
                taken[e] += 1
        for i in range(t):
            top = torch.stack([probs[i][e] for e in choices[i]])
            w = top / top.sum() if cfg_k > 1 else top
            for j, e in enumerate(choices[i]):
                if not keep[i, j]:
                    continue
                h = x[s, i]
                ex = layer.experts
                if ex.gated:
                    a = F.silu(ex.gate_proj.weight[e] @ h) * (ex.up_proj.weight[e] @ h)
                else:
                    a = F.gelu(ex.up_proj.weight[e] @ h + ex.up_proj.bias[e], approximate="tanh")
                y = ex.down_proj.weight[e] @ a
                if ex.down_proj.bias is not None:
                    y = y + ex.down_proj.bias[e]
                out[s, i] = out[s, i] + w[j].to(x.dtype) * y
    if layer.shared is not None:
        out = out + layer.shared(x)
    return out


@pytest.mark.parametrize("flavor,k,cf,shared", [("llama", 2, 0.0, 0), ("llama", 2, 1.0, 1), ("gpt2", 1, 1.25, 0)])
def test_layer_equals_a_naive_loop_forward_and_backward(flavor, k, cf, shared):
    cfg = _cfg(flavor=flavor, moe_top_k=k, moe_capacity_factor=cf, moe_shared_experts=shared, n_kv_heads=None)
    layer = _layer(cfg)
    layer.aux_weight = layer.z_weight = 0.0  # the auxiliary losses are checked on their own below
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, cfg.d_model, generator=g, dtype=torch.float64)
    up = torch.randn(3, 7, cfg.d_model, generator=g, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = layer(xa)
    grads_ours = torch.autograd.grad((ours * up).sum(), [xa, *layer.parameters()])
    ref = _naive(layer, xb)
    grads_ref = torch.autograd.grad((ref * up).sum(), [xb, *layer.parameters()], allow_unused=True)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for (name, _), a, r in zip([("x", None), *layer.named_parameters()], grads_ours, grads_ref):
        torch.testing.assert_close(a, torch.zeros_like(a) if r is None else r, rtol=1e-10, atol=1e-12, msg=name)
    if cf:  # the capacity really dropped something in these cases
        assert layer.stats.dropped > 0


def test_router_path_passes_gradcheck_in_fp64():
    """The routing weights (softmax, top-k renormalized) and the weighted sum, differentiated by finite differences."""
    cfg = _cfg(moe_capacity_factor=1.0)
    layer = _layer(cfg)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w = layer.router.weight.detach().clone().requires_grad_()

    def f(x_, w_):
        with torch.no_grad():
            layer.router.weight.copy_(w_)
        logits = F.linear(x_, w_)
        probs, experts, weights, keep = route(logits, layer.top_k, layer.capacity_factor)
        b, t, d = x_.shape
        return layer.dispatch(
            x_.reshape(b * t, d), experts.reshape(b * t, -1), weights.reshape(b * t, -1), keep.reshape(b * t, -1)
        )

    assert torch.autograd.gradcheck(f, (x.requires_grad_(), w), eps=1e-6, atol=1e-7)


def test_capacity_drops_by_choice_then_position_on_a_hand_made_route():
    """One sequence of 4 tokens, 2 experts, top-2, factor 0.5: C = ceil(0.5 x 2 x 4 / 2) = 2 per expert. First
    choices (0, 0, 1, 0) queue first, by position: expert 0 keeps tokens 0, 1 and drops token 3's first choice;
    expert 1 keeps token 2's. Then the second choices (1, 1, 0, 1): expert 1 has one place left (token 0); expert 0
    is full (token 2 dropped)."""
    first = torch.tensor([[0, 0, 1, 0]])
    logits = torch.where(F.one_hot(first, 2).bool(), 2.0, 0.0)  # [1, 4, 2]: the first choice scores 2, the other 0
    _, experts, _, keep = route(logits, 2, 0.5)
    assert experts[..., 0].tolist() == [[0, 0, 1, 0]] and experts[..., 1].tolist() == [[1, 1, 0, 1]]
    assert keep[..., 0].tolist() == [[True, True, True, False]]
    assert keep[..., 1].tolist() == [[True, False, False, False]]
    # sequences are separate units: the same route twice in a batch drops the same assignments in each
    _, _, _, keep2 = route(torch.cat([logits, logits]), 2, 0.5)
    assert torch.equal(keep2[0], keep[0]) and torch.equal(keep2[1], keep[0])


def test_dropless_drops_nothing():
    cfg = _cfg(moe_capacity_factor=0.0)
    layer = _layer(cfg)
    x = torch.randn(4, 9, cfg.d_model, dtype=torch.float64)
    layer(x)
    s = layer.stats
    assert s.dropped == 0 and s.assigned == 4 * 9 * cfg.moe_top_k
    assert int(s.load[0].sum()) == s.assigned


def test_auxiliary_losses_values_and_their_injected_gradient():
    """Uniform routing gives a balance loss of 1; the gradients the layer starts in backward equal those of the
    loss plus the weighted auxiliary losses, both times the trainer's scale."""
    e = 4
    probs = torch.full((2, 8, e), 1 / e)
    experts = torch.arange(8).remainder(e).view(1, 8, 1).expand(2, 8, 1)
    balance, z = aux_losses(torch.zeros(2, 8, e), probs, load_fraction(experts, e))
    assert balance.item() == pytest.approx(1.0) and z.item() == pytest.approx(math.log(e) ** 2)

    cfg = _cfg(moe_aux_loss=0.3, moe_z_loss=0.05)
    layer = _layer(cfg)
    x = torch.randn(2, 6, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    up = torch.randn(2, 6, cfg.d_model, dtype=torch.float64)
    layer.stats.grad_scale = 0.25
    ours = torch.autograd.grad((layer(x) * up).sum() * 0.25, list(layer.parameters()))
    logits = layer.router(x)
    probs, experts, _, _ = route(logits, cfg.moe_top_k, 0.0)
    balance, z = aux_losses(logits, probs, load_fraction(experts, logits.shape[-1]))
    layer.aux_weight = layer.z_weight = 0.0
    total = ((layer(x) * up).sum() + 0.3 * balance + 0.05 * z) * 0.25
    ref = torch.autograd.grad(total, list(layer.parameters()))
    for (name, _), a, r in zip(layer.named_parameters(), ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-13, msg=name)
    assert ours[0].abs().sum() > 0


def test_a_recomputed_forward_is_not_counted_twice():
    from torch.utils.checkpoint import checkpoint

    cfg = _cfg()
    layer = _layer(cfg)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert layer.stats.forwards == 1 and layer.stats.assigned == 2 * 5 * cfg.moe_top_k


def test_model_places_experts_every_nth_block_and_counts_active_parameters():
    cfg = _cfg(n_layers=4, moe_every=2, moe_shared_experts=1)
    model = build_model(cfg, 0)
    assert cfg.moe_layers == [1, 3]
    assert [type(b.mlp).__name__ for b in model.layers.values()] == ["MLP", "MoE", "MLP", "MoE"]
    assert model.layers["1"].mlp.experts.down_proj.weight.shape == (4, cfg.d_model, 10)
    d = cfg.d_model
    per_expert, dense = 3 * d * 10, 3 * d * 20
    attn = 4 * d * d
    assert matmul_params(cfg, active=False) == 4 * attn + 2 * dense + 2 * (5 * per_expert + 4 * d) + d * 32
    assert matmul_params(cfg) == 4 * attn + 2 * dense + 2 * (3 * per_expert + 4 * d) + d * 32  # top-2 + 1 shared


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"moe_experts": 1}, "model.moe_experts must be 0 (dense) or at least 2"),
        ({"moe_top_k": 5}, "model.moe_top_k must be between 1 and model.moe_experts (4), got 5"),
        ({"moe_every": 0}, "model.moe_every must be at least 1"),
        ({"moe_capacity_factor": -1.0}, "model.moe_capacity_factor must be at least 0"),
    ],
)
def test_bad_moe_shapes_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _cfg(**kw).validate()


def test_hard_routing_sends_every_token_only_to_its_labels_experts():
    """Per-token labels (a sequence may cross documents): counted per layer, each token's assignments go only to its
    label's experts, weighted by the router's softmax over them; without labels the layer says what it needs."""
    cfg = _cfg(n_layers=2, moe_experts=6, moe_top_k=2, moe_router="hard", moe_label_experts=["a:0+3", "b:1+2", "c:4+5"])
    cfg.validate()
    layer = _layer(cfg)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 10, cfg.d_model, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 3, (3, 10), generator=g)
    logits = layer.router(x)
    masked = logits.masked_fill(~layer.allowed(x.device)[labels], float("-inf"))
    _, experts, weights, _ = route(masked, 2, 0.0)
    table = [{0, 3}, {1, 2}, {4, 5}]
    for b in range(3):
        for t in range(10):
            assert set(experts[b, t].tolist()) == table[labels[b, t]]
    assert torch.allclose(weights.sum(-1), torch.ones(3, 10, dtype=torch.float64))
    out = layer(x, labels)
    ref = layer(x, labels[:, :1].expand(3, 10).clone())  # a per-sample label is a per-token one repeated
    assert torch.equal(layer(x, labels[:, 0]), ref) and not torch.equal(out, ref)
    with pytest.raises(ValueError, match="hard routing needs each sample's label"):
        layer(x)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"moe_router": "hard"}, "model.moe_router=hard needs model.moe_label_experts"),
        (
            {"moe_router": "hard", "moe_label_experts": ["a:0", "b:1"]},
            "every label of model.moe_label_experts must name model.moe_top_k (2)",
        ),
        ({"moe_router": "hard", "moe_label_experts": ["a:0+9", "b:1+2"]}, "names expert 9, but there are 4"),
        ({"moe_router": "hard", "moe_label_experts": ["a=0+1"]}, "is not 'label:expert[+expert...]'"),
    ],
)
def test_bad_label_maps_are_refused(kw, message):
    import re

    with pytest.raises(ConfigError, match=re.escape(message)):
        _cfg(**kw).validate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_equals_the_expert_loop(dtype, monkeypatch):
    """The gated experts' one-``grouped_mm``-per-projection path (CPU, no autocast) gives what the loop over the
    experts gives, outputs and gradients, with experts that get no row among them."""
    import trickles.models.moe as moe

    cfg = _cfg(moe_top_k=2, d_model=16, moe_ffn_hidden=24)  # rows of 16-byte multiples, which grouped_mm needs
    experts = _layer(cfg).experts.to(dtype)
    g = torch.Generator().manual_seed(5)
    counts = [5, 0, 9, 2]
    x = torch.randn(sum(counts), cfg.d_model, generator=g).to(dtype)
    up = torch.randn(sum(counts), cfg.d_model, generator=g).to(dtype)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(moe, "GROUPED_MM", torch.nn.functional.grouped_mm if grouped else None)
        assert experts._grouped_mm(x) == grouped  # the path under test is the one taken
        xa = x.clone().requires_grad_()
        y = experts(xa, counts)
        results.append((y, *torch.autograd.grad((y * up).sum(), [xa, *experts.parameters()])))
    for a, b in zip(*results):
        # another summation order: fp32 within a few units of the last place (2e-6 relative measured), bf16 its rounding
        torch.testing.assert_close(
            a, b, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-6 if dtype == torch.float32 else 1e-2
        )
