"""int8 quantization of a trained checkpoint, its checkpoints and commands, and quantization-aware training.

The module's checkpoint: a tiny llama trained 16 steps, then given outlier rows the way trained transformers have
them (LLM.int8(); BMInf's reason for per-row scales) without changing what it computes: every 16th row of each
``up_proj`` is multiplied by 20 and the matching column of ``down_proj`` divided by 20 (SwiGLU is linear in ``up``,
so the float model's loss is unchanged). A 16-step tiny model has no outliers of its own. On it every int8 variant
moves the validation loss by ~1e-5..1e-4 relative, first order in the rounding errors and of either sign, so which
granularity has the lower loss is chance at this size; how far the predictions move (KL to the float model) is
second order and is what the granularity test compares (the benchmark compares losses on a model trained longer).
"""

import copy
import json
import os
import shutil
import sys

import pytest
import torch
from helpers import tiny_config

from trickles.compress import float_model, load_checkpoint, quantize_checkpoint, quantize_model, quantize_weight
from trickles.compress.quantize import dequantize, quantized_names
from trickles.compress.report import validation_loss
from trickles.data import load_tokenizer
from trickles.errors import CheckpointError
from trickles.testing import run_command
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

STEPS, FORK = 16, 6
CPU = torch.device("cpu")
TRAIN = ["train.lr=1e-2", "train.warmup_steps=5"]


def _trainer(tmp, *overrides, steps=STEPS + FORK):
    cfg = tiny_config(tmp, *TRAIN, *overrides, steps=steps)
    return Trainer(cfg, ParallelDims().build(CPU), quiet=True)


def _outliers(model):
    with torch.no_grad():
        for block in model.layers.values():
            rows = torch.arange(0, block.mlp.up_proj.weight.shape[0], 16)
            block.mlp.up_proj.weight[rows] *= 20.0
            block.mlp.down_proj.weight[:, rows] /= 20.0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("quant"))
    tr = _trainer(tmp)
    for _ in range(STEPS):
        tr.train_step()
    natural = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    before = tr.evaluate()
    _outliers(tr.model)
    assert abs(tr.evaluate() - before) < 1e-5 * before  # the same function
    path = tr.save_checkpoint()
    meta = json.load(open(os.path.join(path, "trainer.json")))
    return tmp, path, meta, load_tokenizer(os.path.join(path, "tokenizer")), natural


@torch.no_grad()
def _kl_to(model, ref, meta, tok):
    """Mean KL(float || quantized) of the next-token distributions over the held-out batches: how far quantization
    moved the predictions (second order in the weight error, so it does not cancel the way a loss difference can)."""
    from trickles.config import Config
    from trickles.data import ShardedBatches, load_corpus

    cfg = Config.from_dict(meta["config"])
    val = ShardedBatches(load_corpus(cfg.data, tok, cfg.data.cache_dir).val, cfg.data.seq_len, cfg.train.seed)
    total = 0.0
    for i in range(cfg.train.eval_batches):
        for x, _ in val.val_micro_batches(i, cfg.train.global_batch, cfg.train.global_batch):
            p, q = ref(x).log_softmax(-1), model(x).log_softmax(-1)
            total += float((p.exp() * (p - q)).sum(-1).mean())
    return total / cfg.train.eval_batches


def test_per_row_beats_per_tensor_and_stays_within_2_percent(trained):
    _, path, meta, tok, natural = trained
    model = float_model(path)
    names = quantized_names(model)
    assert "output" in names and "layers.1.mlp.gate_proj" in names
    # reconstruction: strictly better per row, matrix by matrix, on the trained weights with and without outliers
    for weights in ({n: model.get_submodule(n).weight for n in names}, {n: natural[n + ".weight"] for n in names}):
        for n, w in weights.items():
            row = (w - dequantize(*quantize_weight(w, "row"))).pow(2).sum()
            tensor = (w - dequantize(*quantize_weight(w, "tensor"))).pow(2).sum()
            assert row < tensor, n
    base = validation_loss(model, meta, tok)
    losses, kl = {}, {}
    for granularity in ("row", "tensor"):
        for mode in ("weight", "full"):
            q = copy.deepcopy(model)
            quantize_model(q, granularity, mode)
            losses[granularity, mode] = validation_loss(q, meta, tok)
            kl[granularity, mode] = _kl_to(q, model, meta, tok)
    print(f"float {base:.6f}; int8 losses {losses}; KL to float {kl}")
    # the predictions: strictly closer to the float model's per row, in both inference modes
    assert kl["row", "weight"] < kl["tensor", "weight"] and kl["row", "full"] < kl["tensor", "full"]
    assert kl["row", "weight"] > 0
    # the loss: per-row weight-only within 2% of float. (Which granularity has the lower loss is, at this size, chance:
    # int8 moves the loss by ~1e-5..1e-4 relative, first order in the rounding errors, of either sign.)
    assert abs(losses["row", "weight"] - base) <= 0.02 * base


def trickles(*args):
    return run_command(
        [sys.executable, "-m", "trickles", *args], text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )


def test_quantize_command_checkpoint_and_damage(trained, capsys):
    tmp, path, meta, tok, _ = trained
    out = os.path.join(tmp, "int8")
    r = trickles("compress", "quantize", path, out)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["manifest.json", "model-rank00000.safetensors", "tokenizer", "trainer.json"]
    q = json.load(open(os.path.join(out, "trainer.json")))["quantization"]
    assert q["bits"] == 8 and q["granularity"] == "row" and "layers.0.attn.q_proj" in q["modules"]
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model-rank00000.safetensors"), "pt") as f:
        assert f.get_tensor("layers.1.mlp.down_proj.weight").dtype == torch.int8
        assert f.get_tensor("layers.1.mlp.down_proj.weight_scale").shape == (64,)
        assert f.get_tensor("embed.weight").dtype == torch.float32
    # the checkpoint loads like any other: the same loss as quantizing in memory, in both inference modes
    for mode in ("weight", "full"):
        model, _, _ = load_checkpoint(out, int8=mode)
        ref = copy.deepcopy(float_model(path))
        quantize_model(ref, "row", mode)
        assert validation_loss(model, meta, tok) == pytest.approx(validation_loss(ref, meta, tok), rel=1e-6)
    r = trickles("generate", out, "--int8", "full", "--max-new-tokens", "8", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr
    # refused, status 2, one line, nothing written: an existing target, unsupported bits, --int8 on a float checkpoint
    from trickles.cli import main

    for args in (
        ("compress", "quantize", path, out),
        ("compress", "quantize", path, out + "-4", "--bits", "4"),
        ("generate", path, "--int8", "weight"),
    ):
        assert main(list(args)) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not any(n.startswith("int8-4") or n.endswith(".tmp") for n in os.listdir(tmp))
    with pytest.raises(CheckpointError, match="int8 checkpoint for inference"):
        _trainer(tmp).load_checkpoint(out)  # not a training state
    # one byte of one int8 tensor altered: the manifest's checksum refuses it
    bad = os.path.join(tmp, "int8-damaged")
    shutil.copytree(out, bad)
    with open(os.path.join(bad, "model-rank00000.safetensors"), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x55]))
    assert main(["generate", bad, "--int8", "full", "--max-new-tokens", "4"]) == 2
    assert "checksum" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(bad)


def test_qat_then_int8_is_no_worse_than_post_training_int8(trained):
    """From the module's checkpoint, 6 more steps as float training (then int8 after training) and as QAT (whose
    final checkpoint exports to int8 itself): the QAT model's int8 loss is lower or equal, in both inference modes."""
    tmp, path, meta, tok, _ = trained
    losses = {}
    for qat in (False, True):
        tr = _trainer(tmp, f"train.qat={str(qat).lower()}", f"train.out_dir={tmp}/fork-{qat}", "train.eval_every=0")
        tr.load_checkpoint(path)
        tr.fit()
        exported = os.path.join(tmp, f"fork-{qat}", f"int8_step_{STEPS + FORK:06d}")
        assert os.path.isdir(exported) == qat  # only QAT exports by itself
        if not qat:
            quantize_checkpoint(os.path.join(tmp, f"fork-{qat}"), exported)
        for mode in ("weight", "full"):
            model, _, m = load_checkpoint(exported, int8=mode)
            assert m["quantization"]["qat"] == qat
            losses[qat, mode] = validation_loss(model, meta, tok)
    print(
        f"post-training int8: weight-only {losses[False, 'weight']:.5f}, full {losses[False, 'full']:.5f}; "
        f"QAT int8: weight-only {losses[True, 'weight']:.5f}, full {losses[True, 'full']:.5f}"
    )
    assert losses[True, "full"] <= losses[False, "full"]
    assert losses[True, "weight"] <= losses[False, "weight"]


def test_resuming_qat_is_exact(tmp_path):
    def run(steps, resume=None, qat=True):
        tr = _trainer(str(tmp_path), f"train.qat={str(qat).lower()}", "model.dropout=0.1", steps=4)
        if resume:
            tr.load_checkpoint(resume)
        losses = [tr.train_step()["loss"] for _ in range(tr.step, steps)]
        return tr, losses

    straight, all_losses = run(4)
    first, head = run(2)
    path = first.save_checkpoint()
    resumed, tail = run(4, path)
    assert head + tail == all_losses  # bitwise
    for (n, a), b in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(a, b), n
    assert run(4, qat=False)[1] != all_losses  # QAT was on
