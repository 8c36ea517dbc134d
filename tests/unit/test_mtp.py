"""Multi-token prediction (``model.mtp_depth``, trickles/models/mtp.py): the loss against a hand computation from the
module definition, the targets each depth trains, ``mtp_depth = 0`` as the model without it, inference without the
modules, the one-line refusals, and the Hugging Face layout of DeepSeek-V3's MTP layers both ways."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from trickles.config import Config
from trickles.errors import ConfigError
from trickles.models.config import ModelConfig
from trickles.models.mtp import depth_logits, depth_targets
from trickles.models.transformer import build_model

CFG = ModelConfig(
    n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, mtp_depth=2, mtp_weight=0.3
)


def _batch(t: int = 12):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (2, t), generator=g)
    y = torch.randint(0, 64, (2, t), generator=g)
    y[0, 3] = -100  # an untrained target: ignored at every depth that reads it
    return x, y


def _perturbed(cfg: ModelConfig):
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # norms not all ones: a norm left out or applied twice shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def test_loss_is_the_hand_computation():
    """Depth k by the module definition on the shortened sequences -- h0 = norm(h_L); x = eh_proj[enorm(Emb(t[i+k]));
    hnorm(h{k-1})]; hk = norm_k(block(x)); CE against t[i+1+k] -- on positions 0..T-k-1 only, no filler past the
    end: equal to the model's, which runs every depth over all T positions and masks the last k."""
    model = _perturbed(CFG).train()
    x, y = _batch()
    t = x.shape[1]
    loss = model(x, target=y)
    with torch.no_grad():
        rope = model.rope(0, t)
        h = model.embed(x)
        for block in model.layers.values():
            h = block(h, rope)
        rep = model.norm(h)
        main = F.cross_entropy(model.output(rep).flatten(0, 1), y.flatten(), ignore_index=-100)
        depths = []
        for k, layer in enumerate(model.mtp.values(), start=1):
            n = t - k
            e = model.embed(x[:, k:])
            inp = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(rep[:, :n])], dim=-1))
            rep = layer.norm(layer.block(inp, (rope[0][:n], rope[1][:n])))
            logits = model.output(rep)
            depths.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten(), ignore_index=-100))
        hand = main + 0.3 * (depths[0] + depths[1]) / 2
    torch.testing.assert_close(loss.detach(), hand, rtol=1e-6, atol=1e-6)
    assert abs(float(hand - main)) > 0.1  # the depths' term is there
    loss.backward()
    for name, p in model.named_parameters():  # every module trains, the shared embedding and head included
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_depth_targets_stop_at_the_sequence_and_document_end():
    y = torch.tensor([[10, 11, 12, 13, 14, 15]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert depth_targets(y, 1).tolist() == [[11, 12, 13, 14, 15, -100]]
    assert depth_targets(y, 2).tolist() == [[12, 13, 14, 15, -100, -100]]
    # t[i+k] in another document than t[i]: positions 1, 2 at depth 1 (t[2] -> t[3] crosses), 0..2 at depth 2
    assert depth_targets(y, 1, docs).tolist() == [[11, 12, -100, 14, 15, -100]]
    assert depth_targets(y, 2, docs).tolist() == [[12, -100, -100, 15, -100, -100]]


def test_depth_zero_is_the_model_without_it_and_inference_ignores_the_modules():
    """``mtp_depth = 0``: no module, no parameter, the same names and values, and a training loss bitwise the main
    path's; with depths, the main parameters start the same and eval/inference computes the main path alone."""
    x, y = _batch()
    plain = build_model(dataclasses.replace(CFG, mtp_depth=0), seed=0).train()
    deep = build_model(CFG, seed=0).train()
    assert plain.mtp is None and not any(n.startswith("mtp.") for n, _ in plain.named_parameters())
    main = {n: p for n, p in deep.named_parameters() if not n.startswith("mtp.")}
    assert list(main) == [n for n, _ in plain.named_parameters()]
    assert all(torch.equal(p, main[n]) for n, p in plain.named_parameters())
    with torch.no_grad():
        h = plain.embed_tokens(x)
        for block in plain.layers.values():
            h = block(h, plain.rope(0, x.shape[1]))
        assert torch.equal(plain(x, target=y), plain.head(h, y))
        assert not torch.equal(deep(x, target=y), plain(x, target=y))  # training adds the depths' loss
        deep.eval()
        assert torch.equal(deep(x, target=y), plain(x, target=y))
        assert torch.equal(deep(x), plain(x))
        drafts = depth_logits(deep, x)
    assert len(drafts) == 2 and drafts[0].shape == (2, 12, 64)


def _config(*sets: str) -> Config:
    return Config.load(None, ["model.preset=tiny", "data.seq_len=32", "model.mtp_depth=2", *sets])


@pytest.mark.parametrize(
    "sets,world,needle",
    [
        (["data.seq_len=2"], 1, "model.mtp_depth (2) predicts up to 3 tokens ahead, but data.seq_len is 2"),
        (["parallel.cp=2"], 2, "does not run with parallel.cp=2"),
        (["parallel.tp=4", "parallel.tp_mode=2d"], 4, "does not run with parallel.tp_mode=2d"),
        (
            ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2", "model.n_layers=4"],
            2,
            "does not run with parallel.schedule=zb-v",
        ),
        (["parallel.pp=2", "parallel.zero=3"], 2, "does not run with parallel.zero=3 at parallel.pp > 1"),
        (["model.mtp_depth=-1"], 1, "model.mtp_depth must be 0 (off) or a number of depths"),
        (["model.mtp_weight=-0.1"], 1, "model.mtp_weight must be at least 0"),
    ],
)
def test_refusals_are_one_line(sets, world, needle):
    with pytest.raises(ConfigError) as e:
        _config(*sets).validate(world)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_layouts_that_place_it():
    for sets, world in ((["parallel.pp=2", "train.micro_batch=2"], 2), (["parallel.tp=2"], 2), ([], 1)):
        _config(*sets).validate(world)


DEEPSEEK = dict(
    vocab_size=288,  # the byte tokenizer's 257 fit (train.init_from)
    hidden_size=48,
    intermediate_size=80,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    moe_intermediate_size=16,
    n_shared_experts=1,
    routed_scaling_factor=1.7,
    bos_token_id=1,
    eos_token_id=2,
)
MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _deepseek_dir(tmp_path):
    """A DeepSeek-V3 directory written by hand: transformers' 3-layer model saved, its config turned into 2 layers and
    one MTP layer (``num_nextn_predict_layers = 1``), the third layer's tensors left as the MTP layer's block and its
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and ``shared_head.head`` (a copy of ``lm_head``) added."""
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    from safetensors.torch import load_file, save_file

    with torch.random.fork_rng():
        torch.manual_seed(3)
        ref = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(**DEEPSEEK, num_hidden_layers=3, attn_implementation="eager")
        )
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    path = tmp_path / "hf"
    ref.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors.update({f"model.layers.2.{n}": 1 + 0.1 * torch.randn(48, generator=g) for n in MTP_NAMES[:2]})
    tensors["model.layers.2.eh_proj.weight"] = 0.1 * torch.randn(48, 96, generator=g)
    tensors["model.layers.2.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(48, generator=g)
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    config.pop("num_mtp_layers", None)
    (path / "config.json").write_text(json.dumps(config))
    return path, tensors


def test_deepseek_v3_mtp_layers_import_and_export(tmp_path):
    from safetensors.torch import load_file

    from trickles.models import load_hf, save_hf

    path, tensors = _deepseek_dir(tmp_path)
    ours = load_hf(path)
    assert ours.cfg.n_layers == 2 and ours.cfg.mtp_depth == 1 and ours.mtp["0"].block.moe
    own = dict(ours.named_parameters()) | dict(ours.named_buffers())
    for name in MTP_NAMES:  # the module's own tensors
        mine = "mtp.0.norm.weight" if name.startswith("shared_head") else f"mtp.0.{name}"
        assert torch.equal(own[mine], tensors[f"model.layers.2.{name}"]), name
    for hf, mine in (  # the block's, under the family's block names
        ("self_attn.q_a_proj.weight", "attn.q_a_proj.weight"),
        ("self_attn.kv_b_proj.weight", "attn.kv_b_proj.weight"),
        ("input_layernorm.weight", "attn_norm.weight"),
        ("mlp.gate.weight", "mlp.router.weight"),
        ("mlp.gate.e_score_correction_bias", "mlp.router.e_score_correction_bias"),
        ("mlp.shared_experts.down_proj.weight", "mlp.shared.down_proj.weight"),
    ):
        assert torch.equal(own[f"mtp.0.block.{mine}"], tensors[f"model.layers.2.{hf}"]), hf
    assert torch.equal(own["output.weight"], tensors["lm_head.weight"])
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert len(theirs.model.layers) == 2  # transformers reads no MTP layer (it leaves layer 2's tensors unread)
    x = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # inference: the main path alone, transformers' logits
        logits = ours.eval()(x)
        want = theirs(x).logits
        assert (logits - want).abs().max() <= 1e-5 * want.abs().max()
        assert len(depth_logits(ours, x)) == 1

    out = save_hf(ours, tmp_path / "export")
    written = load_file(out / "model.safetensors")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert written.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(written[name], t.to(written[name].dtype)), name
    again = load_hf(out)
    assert all(torch.equal(p, own[n]) for n, p in again.named_parameters())


@pytest.mark.parametrize(
    "sets,world",
    [
        (["parallel.pp=2", "train.micro_batch=2"], 2),
        (["parallel.pp=2", "train.micro_batch=2", "model.preset=gpt2-tiny", "parallel.tp=2"], 4),  # tied, positions
    ],
)
def test_memory_report_counts_the_last_stage_modules(sets, world):
    """The memory report's parameters of each pipeline rank are those keep_stage leaves it: the prediction modules
    and a copy of the embedding (and positions) on the last rank only."""
    from trickles.memory import meta
    from trickles.models.config import resolve_model
    from trickles.parallel.engine import unique_named_parameters
    from trickles.parallel.pipeline.schedules import Shape
    from trickles.parallel.pipeline.stages import keep_stage, partition_layers

    cfg = _config(*sets)
    dims = cfg.validate(world)
    mc = resolve_model(cfg.model, 257, cfg.data.seq_len)
    shape = Shape(dims.pp, cfg.parallel.virtual_stages, cfg.batch_plan(dims.dp)[1])
    parts = partition_layers(mc.n_layers, shape.stages, cfg.parallel.pipeline_layers)
    rm = meta.rank_model(mc, dims, cfg.parallel.sequence_parallel, 0, torch.float32)
    for r in range(dims.pp):
        meta._CACHE.clear()  # a model of its own to prune
        pruned = meta.rank_model(mc, dims, cfg.parallel.sequence_parallel, 0, torch.float32).module
        meta._CACHE.clear()
        keep_stage(pruned, r, shape, parts)
        got = meta.stage_parameters(rm, set(parts[r]), r == 0, r == dims.pp - 1, mc.tied)
        want = unique_named_parameters(pruned)
        assert [n for n, _ in got] == [n for n, _ in want], r
        names = [n for n, _ in got]
        assert any(n.startswith("mtp.") for n in names) == (r == 1) and "embed.weight" in names


def test_init_from_a_directory_keeps_the_runs_depth(tmp_path):
    """``train.init_from`` a DeepSeek-V3 directory with ``model.mtp_depth=2``: the run keeps its depth and weight, the
    directory's MTP layer starts depth 1 and depth 2 starts from its initial value."""
    from trickles.models.transformer import Transformer, initial_value
    from trickles.train.trainer_state import init_source

    path, tensors = _deepseek_dir(tmp_path)
    cfg = Config.load(None, [f"train.init_from={path}", "model.mtp_depth=2", "model.mtp_weight=0.3", "data.seq_len=16"])
    cfg.validate(1)
    assert (cfg.model.n_layers, cfg.model.mtp_depth, cfg.model.mtp_weight, cfg.model.attention) == (2, 2, 0.3, "mla")
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg.model, max_seq_len=16))
    value = init_source(str(path), model, seed=5)
    own = dict(model.named_parameters())
    assert torch.equal(
        value("mtp.0.eh_proj.weight", own["mtp.0.eh_proj.weight"]), tensors["model.layers.2.eh_proj.weight"]
    )
    name = "mtp.1.block.attn.q_a_proj.weight"
    fresh = initial_value(model.cfg, name, tuple(own[name].shape), 5)
    assert torch.equal(value(name, own[name]), fresh)


@pytest.mark.parametrize("flavor", ["llama", "gpt2"])
def test_activation_estimate_counts_the_modules(flavor):
    """The memory report's head activations include the modules': the activation meter's bytes, exactly (one rank,
    the unfused loss; the tensor-parallel layouts are checked through ``trickles memory --measure``)."""
    from trickles.memory.activations import ActivationMeter, activation_bytes

    extra = {} if flavor == "llama" else dict(flavor="gpt2", n_kv_heads=None)
    cfg = dataclasses.replace(CFG, **extra)
    x, y = _batch()
    y[0, 3] = 7  # every target trained (as the estimate assumes)
    model = build_model(cfg, seed=0).train()
    with ActivationMeter(model) as meter:
        model(x, target=y)
    assert meter.per_layer["head"] == activation_bytes(cfg, 2, 12)["head"]
    without = activation_bytes(dataclasses.replace(cfg, mtp_depth=0), 2, 12)["head"]
    assert meter.per_layer["head"] > 3 * without  # the two depths' blocks and losses are most of it
