"""``trickles compress prune`` and ``report`` end to end: the pruned checkpoint's parameters as the report counts them,
its training at tensor parallelism from ``train.init_from`` (like one process, starting from the pruned weights)."""

import json
import os

import pytest
import torch
from helpers import tiny_config, trained_checkpoint

from trickles.cli import main
from trickles.compress.report import compress_report, load_model
from trickles.models.transformer import count_params
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

TINY = [
    "model.preset=tiny",
    "data.seq_len=32",
    "data.max_bytes=120000",
    "train.global_batch=8",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "train.plot=false",
    "train.lr=3e-3",
]


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A tiny llama trained 8 steps, and its pruned copy (half the key/value groups, a quarter of the channels, one
    block)."""
    tmp = tmp_path_factory.mktemp("compress")
    src = trained_checkpoint(tmp, 8)
    out = str(tmp / "pruned")
    assert (
        main(["compress", "prune", src, out, "--heads", "0.5", "--ffn", "0.25", "--layers", "1", "--batches", "2"]) == 0
    )
    return tmp, src, out


def expected_params(cfg) -> int:
    """The pruned llama's parameters from its config, term by term (untied embedding and output)."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    block = 2 * d + d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2 + 3 * d * f
    return 2 * cfg.vocab_size * d + d + cfg.n_layers * block


def test_prune_writes_a_smaller_checkpoint_and_the_report_counts_it(pruned, capsys):
    tmp, src, out = pruned
    model, _, meta, _ = load_model(out)
    cfg = model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_dim) == (1, 2, 1, 16, 96)
    assert meta["step"] == 0 and meta["pruned_from"]["score"] == "taylor"
    rows = compress_report([src, out], tokens=8)
    assert rows[1].params == count_params(model) == expected_params(cfg)
    assert rows[0].params == count_params(load_model(src)[0]) > rows[1].params
    assert rows[1].disk_bytes < rows[0].disk_bytes and rows[1].disk_bytes >= 4 * rows[1].params
    assert all(r.val_loss == r.val_loss and r.tokens_per_s > 0 for r in rows)
    assert main(["compress", "report", src, out, "--tokens", "4"]) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table and f"{rows[1].params:,}" in table
    # refusals: an existing output, more blocks than the model has
    assert main(["compress", "prune", src, out]) == 2
    assert main(["compress", "prune", src, str(tmp / "x"), "--layers", "2"]) == 2
    assert not os.path.exists(tmp / "x") and not os.path.exists(tmp / "x.tmp")


def test_pruned_checkpoint_trains_at_tp2_like_one_process(pruned, tmp_path):
    _, _, out = pruned
    common = TINY + [f"data.cache_dir={tmp_path}/cache", "train.steps=3", f"train.init_from={out}"]
    args = ["train", "--quiet", "--nproc", "2"] + [
        a for kv in common + ["parallel.tp=2", f"train.out_dir={tmp_path}/tp2"] for a in ("--set", kv)
    ]
    assert main(args) == 0
    with open(tmp_path / "tp2" / "metrics.jsonl") as f:
        tp2 = [json.loads(line)["loss"] for line in f]
    cfg = tiny_config(tmp_path, f"train.init_from={out}", steps=3)
    cfg.validate(1)
    assert cfg.model.n_heads == 2 and cfg.model.head_size == 16  # the pruned shape, not the preset's
    one = Trainer(cfg, ParallelDims().build(torch.device("cpu")), quiet=True)
    x, y = one.train_data.micro_batches(0, 8, 8)[0]
    model = load_model(out)[0]
    with torch.no_grad():
        first = float(model(x, target=y))  # the pruned model's loss on the first batch: training starts from it
    losses = [one.train_step()["loss"] for _ in range(3)]
    assert abs(losses[0] - first) < 1e-5
    # tensor parallel: same losses as one process within 1e-4 relative (the layout tests' tolerance)
    assert max(abs(a - b) / b for a, b in zip(tp2, losses)) < 1e-4, (tp2, losses)
    assert losses[2] != losses[0]


def test_the_report_reads_an_int8_checkpoint_beside_its_float_source(pruned):
    """The int8 copy of the source has as many weights as it (its codes counted, not its scales), fewer than half its
    bytes on disk (the projections shrink 4x; this tiny model's fp32 embeddings are a third of it), and a held-out loss
    within 2% of the float model's; every model decodes."""
    tmp, src, _ = pruned
    q = str(tmp / "int8")
    assert main(["compress", "quantize", src, q]) == 0
    rows = compress_report([src, q], tokens=4)
    assert rows[1].params == rows[0].params
    assert rows[1].disk_bytes < 0.5 * rows[0].disk_bytes
    assert abs(rows[1].val_loss - rows[0].val_loss) <= 0.02 * rows[0].val_loss
    assert all(r.tokens_per_s > 0 for r in rows)


def test_pruning_scores_on_the_runs_first_training_batches_in_order(pruned):
    """``calibration_batches(meta, ..., "train", k)``: batch ``i`` is the run's global batch ``i`` (samples
    ``i B .. (i+1) B``), exactly what the trainer's loader gave at step ``i``."""
    from trickles.compress.report import calibration_batches
    from trickles.config import Config
    from trickles.data.corpus import load_corpus
    from trickles.data.loader import ShardedBatches

    _, src, _ = pruned
    _, tokenizer, meta, _ = load_model(src, fused_proj=False)
    cfg = Config.from_dict(meta["config"])
    b = cfg.train.global_batch
    data = ShardedBatches(load_corpus(cfg.data, tokenizer, cfg.data.cache_dir).train, cfg.data.seq_len, cfg.train.seed)
    got = calibration_batches(meta, tokenizer, "train", 3)
    assert len(got) == 3
    for i, (x, y) in enumerate(got):
        ex, ey = data.micro_batches(i * b, b, b)[0][:2]
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert not torch.equal(got[0][0], got[1][0])
