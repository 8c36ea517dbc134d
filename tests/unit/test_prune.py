"""Structured pruning: units whose output weights are zero prune away exactly; the pruned model exports to Hugging
Face."""

import dataclasses

import pytest
import torch

from trickles.compress.prune import measure, plan, prune_model, pruned_config
from trickles.models import ModelConfig, build_model

VOCAB, SEQ = 96, 12


def tiny(**kw) -> ModelConfig:
    base = dict(
        flavor="llama",
        n_layers=3,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        fused_proj=False,
        kernels="torch",
    )
    return ModelConfig(**{**base, **kw})


def noisy(cfg: ModelConfig, seed: int = 0):
    model = build_model(cfg, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def batches(n=3, vocab=VOCAB):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, vocab, (2, SEQ), generator=g), torch.randint(0, vocab, (2, SEQ), generator=g))
        for _ in range(n)
    ]


DEAD_GROUP = {0: 1, 1: 0, 2: 1}  # per layer: the key/value group whose heads' o_proj columns are zeroed


def kill_units(model):
    """Zeroes, in every layer, the o_proj columns of one key/value group's heads and the down_proj columns of a
    quarter of the channels; returns the channels zeroed per layer."""
    cfg = model.cfg
    rep, d = cfg.n_heads // cfg.kv_heads, cfg.head_dim
    dead_channels = {}
    with torch.no_grad():
        for key, block in model.layers.items():
            layer = int(key)
            g = DEAD_GROUP[layer]
            block.attn.o_proj.weight[:, g * rep * d : (g + 1) * rep * d] = 0
            chans = torch.randperm(cfg.ffn_dim, generator=torch.Generator().manual_seed(layer))[: cfg.ffn_dim // 4]
            block.mlp.down_proj.weight[:, chans] = 0
            dead_channels[layer] = set(chans.tolist())
    return dead_channels


@pytest.mark.parametrize("flavor", ["llama", "gpt2"])
@pytest.mark.parametrize("score", ["taylor", "activation"])
def test_zero_output_units_prune_to_identical_logits(score, flavor):
    cfg = tiny(flavor=flavor, n_kv_heads=None if flavor == "gpt2" else 2)
    model = noisy(cfg)
    dead = kill_units(model)
    imp = measure(model, batches(), score)
    # the dead units score exactly zero, every live one more
    for layer, g in DEAD_GROUP.items():
        assert all((imp.groups[layer][i] == 0) == (i == g) for i in range(cfg.kv_heads))
        assert all((imp.channels[layer][c] == 0) == (c in dead[layer]) for c in range(cfg.ffn_dim))
    # llama: 2 groups of 2 heads, remove half; gpt2: 4 groups of one head, remove a quarter
    p = plan(imp, cfg, heads=0.5 if flavor == "llama" else 0.25, ffn=0.25)
    for layer in range(cfg.n_layers):
        assert set(p.channels[layer]).isdisjoint(dead[layer]) and len(p.channels[layer]) == 96
        assert DEAD_GROUP[layer] not in p.groups[layer] and len(p.groups[layer]) == cfg.kv_heads - 1
    small = prune_model(model, p)
    assert (small.cfg.n_heads, small.cfg.head_dim, small.cfg.ffn_hidden) == (2 if flavor == "llama" else 3, 16, 96)
    x = batches(1)[0][0]
    with torch.no_grad():
        assert torch.equal(small(x), model(x)), "pruning units with zero output weights changed the logits"


def test_removing_a_live_unit_changes_logits():
    """The exactness check above can fail: pruning a live group does change the logits."""
    model = noisy(tiny())
    imp = measure(model, batches(), "taylor")
    p = plan(imp, model.cfg, heads=0.5)
    x = batches(1)[0][0]
    with torch.no_grad():
        assert not torch.allclose(prune_model(model, p)(x), model(x), atol=1e-4)


def test_blocks_rank_by_score_and_head_size_is_kept():
    model = noisy(tiny())
    with torch.no_grad():  # block 1 adds nothing to the residual stream
        model.layers["1"].attn.o_proj.weight.zero_()
        model.layers["1"].mlp.down_proj.weight.zero_()
    for score in ("taylor", "activation"):
        imp = measure(model, batches(), score)
        p = plan(imp, model.cfg, heads=0.5, layers=1)
        assert p.layers == [0, 2]
    small = prune_model(model, p)
    cfg = small.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model) == (2, 2, 1, 16, 64)
    assert sorted(small.layers) == ["0", "1"]
    with torch.no_grad():  # block 2 became block 1, with its weights
        assert torch.equal(small.layers["1"].mlp_norm.weight, model.layers["2"].mlp_norm.weight)
    with pytest.raises(Exception, match="--layers"):
        plan(imp, model.cfg, layers=3)


def test_multiple_of_keeps_tensor_parallel_counts():
    cfg = tiny(n_heads=8, n_kv_heads=8)
    imp = measure(noisy(cfg), batches(1), "activation")
    p = plan(imp, cfg, heads=0.4, ffn=0.35, multiple_of=2)  # 8 - 3 = 5 groups -> 4; 128 - 45 = 83 channels -> 82
    new = pruned_config(cfg, p)
    assert (new.n_heads, new.kv_heads, new.ffn_hidden) == (4, 4, 82)
    assert (
        pruned_config(cfg, plan(imp, cfg, heads=0.4, ffn=0.35)).n_heads,
        plan(imp, cfg, ffn=0.35).channels[0].__len__(),
    ) == (5, 83)


def test_fused_model_prunes_like_unfused():
    cfg = tiny()
    unfused = noisy(cfg)
    fused = build_model(dataclasses.replace(cfg, fused_proj=True), 0)
    from trickles.models.fused import fuse_state
    from trickles.train.checkpoint import unique_state

    fused.load_state_dict(
        fuse_state(fused.cfg, {k: v.detach() for k, v in unique_state(unfused).items()}), strict=False
    )
    p = plan(measure(unfused, batches(), "taylor"), cfg, heads=0.5, ffn=0.5)
    x = batches(1)[0][0]
    with torch.no_grad():
        assert torch.allclose(prune_model(fused.eval(), p)(x), prune_model(unfused, p)(x), atol=1e-5)


def test_pruned_model_exports_to_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    from trickles.models import load_hf, save_hf

    model = noisy(tiny(d_model=48, n_heads=6, n_kv_heads=3))  # 3 groups of 2 heads of size 8; one group goes
    p = plan(measure(model, batches(), "taylor"), model.cfg, heads=0.34, ffn=0.25, layers=1)
    small = prune_model(model, p)
    assert small.cfg.n_heads == 4 and small.cfg.head_dim * small.cfg.n_heads != small.cfg.d_model
    save_hf(small, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa").eval()
    x = batches(1)[0][0]
    with torch.no_grad():
        ours, theirs = small.eval()(x), hf(x).logits
        assert (ours - theirs).abs().max().item() <= 1e-5
        back = load_hf(tmp_path / "hf")
        assert back.cfg.head_dim == small.cfg.head_dim and torch.equal(back(x), ours)


def test_taylor_scores_sum_every_weight_and_bias_of_the_unit():
    """A llama with a bias on every projection: a channel's score is ``sum |w dL/dw|`` over its gate and up rows, their
    biases' elements and its down column; a group's over its q, k, v rows (and biases) and o columns."""
    cfg = tiny(n_layers=1, qkv_bias=True, o_bias=True, mlp_bias=True)
    model = noisy(cfg)
    data = batches(2)
    imp = measure(model, data, "taylor")
    totals = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for x, y in data:
        model.zero_grad(set_to_none=True)
        model(x, target=y).backward()
        for n, p in model.named_parameters():
            totals[n] += (p * p.grad).abs().detach()
    t = {n.removeprefix("layers.0."): v for n, v in totals.items()}
    channels = t["mlp.down_proj.weight"].sum(0)
    for part in ("gate", "up"):
        channels = channels + t[f"mlp.{part}_proj.weight"].sum(1) + t[f"mlp.{part}_proj.bias"]
    assert t["mlp.gate_proj.bias"].min() > 0
    assert torch.allclose(imp.channels[0], channels.double(), rtol=1e-5, atol=0)
    rep, d = cfg.n_heads // cfg.kv_heads, cfg.head_dim
    for g in range(cfg.kv_heads):
        q, kv = slice(g * rep * d, (g + 1) * rep * d), slice(g * d, (g + 1) * d)
        s = t["attn.q_proj.weight"][q].sum() + t["attn.q_proj.bias"][q].sum() + t["attn.o_proj.weight"][:, q].sum()
        s = s + sum(t[f"attn.{p}_proj.weight"][kv].sum() + t[f"attn.{p}_proj.bias"][kv].sum() for p in "kv")
        assert float(imp.groups[0][g]) == pytest.approx(float(s), rel=1e-5)


def test_a_full_width_q_k_norm_prunes_with_its_heads():
    """OLMo 2's q/k norms run along all heads' features: the pruned model keeps the kept groups' slice of each weight
    (the query heads' of q's, the key/value heads' of k's); pruning channels only leaves the logits exact."""
    cfg = tiny(qk_norm="full", norm_placement="post")
    model = noisy(cfg)
    dead = kill_units(model)
    p = plan(measure(model, batches(), "taylor"), cfg, heads=0.5, ffn=0.25)
    small = prune_model(model, p)
    rep, d = cfg.n_heads // cfg.kv_heads, cfg.head_dim
    for layer in range(cfg.n_layers):
        (g,) = p.groups[layer]
        assert set(p.channels[layer]).isdisjoint(dead[layer])
        old, new = model.layers[str(layer)].attn, small.layers[str(layer)].attn
        assert torch.equal(new.q_norm.weight, old.q_norm.weight[g * rep * d : (g + 1) * rep * d])
        assert torch.equal(new.k_norm.weight, old.k_norm.weight[g * d : (g + 1) * d])
    channels_only = prune_model(model, plan(measure(model, batches(), "taylor"), cfg, ffn=0.25))
    x = batches(1)[0][0]
    with torch.no_grad():
        assert torch.equal(channels_only(x), model(x))
