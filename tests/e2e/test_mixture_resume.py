"""Training on a mixture of three sources (JSONL, parquet, a saved dataset): the metrics count each source's tokens and
validation loss; a resume at step k gives exactly the batches and losses of the run that went on, and a checkpoint
written at dp2 continues at dp1 from the same point of the mixture. The same texts as parquet and as JSONL train
alike (same batches, same losses), and a source's validation loss in the mixture is the one a run on that source alone
sees."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import tiny_config

from trickles.data.mixture import MixedBatches
from trickles.testing import run_ranks
from trickles.train.metrics import read_metrics
from trickles.train.trainer import Trainer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()  # (its "Saving the dataset" bars)

CPU = torch.device("cpu")
WEIGHTS = (0.5, 0.3, 0.2)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three sources of short lines of the standard library's sources, and source b's texts as JSONL too."""
    import argparse
    import inspect
    import typing

    d = tmp_path_factory.mktemp("mixture")
    lines = [line for m in (argparse, typing, inspect) for line in inspect.getsource(m).splitlines() if line.strip()]
    a, b, c = lines[:600], lines[600:1200], lines[1200:1800]
    with open(d / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in a)
    with open(d / "b.jsonl", "w") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in b)
    pq.write_table(pa.table({"body": b}), d / "b.parquet", row_group_size=100)
    datasets.Dataset.from_dict({"text": c}).save_to_disk(str(d / "c"))
    return d


def _mixture(d, out, *overrides, steps=4):
    s = [f"{d}/a.jsonl:{WEIGHTS[0]}", f"{d}/b.parquet:{WEIGHTS[1]}", f"{d}/c:{WEIGHTS[2]}"]
    return tiny_config(
        d, f"data.sources={','.join(s)}", "data.text_field=body", f"train.out_dir={out}", *overrides, steps=steps
    )


def _text_field_a_and_c(cfg):
    """a and c hold their text under "text", b under data.text_field ("body")."""
    cfg.data.sources[0].text_field = cfg.data.sources[2].text_field = "text"
    return cfg


def _trainer(cfg, world: int = 1):
    return Trainer(_text_field_a_and_c(cfg), cfg.validate(world).build(CPU), quiet=True)


def test_parquet_trains_like_jsonl_and_a_sources_validation_loss_is_its_own(sources, tmp_path):
    d = sources
    alone = {}
    for name in ("b.parquet", "b.jsonl"):
        cfg = tiny_config(d, f"data.source={d}/{name}", "data.text_field=body", f"train.out_dir={tmp_path}/{name}")
        tr = Trainer(cfg, cfg.validate(1).build(CPU), quiet=True)
        alone[name] = [tr.evaluate()] + [tr.train_step()["loss"] for _ in range(2)]
    assert alone["b.parquet"] == alone["b.jsonl"]  # bitwise: the same tokens, so the same batches
    mixed = _trainer(_mixture(d, tmp_path / "mixed"))
    assert mixed.evaluate() == pytest.approx(mixed.corpus.weighted(mixed.source_val_loss), rel=1e-12)
    assert list(mixed.source_val_loss) == ["a", "b", "c"]
    assert mixed.source_val_loss["b"] == alone["b.parquet"][0]  # the same model, the same held-out windows


def _steps(tr, n):
    return [tr.train_step()["loss"] for _ in range(n)]


def _dp2_checkpoint(d, out):
    """Two steps on two data-parallel ranks, then a checkpoint; every rank's first micro-batch of step 3 too."""
    tr = _trainer(_mixture(d, out), world=2)
    _steps(tr, 2)
    path = tr.save_checkpoint()
    return path, tr.train_data.micro_batches(tr.consumed, 8, tr.micro_batch)


def test_resume_and_reshard_continue_the_mixture(sources, tmp_path):
    d = sources
    cfg = _mixture(
        d,
        tmp_path / "straight",
        "train.eval_every=2",
        "train.eval_batches=1",
        "train.checkpoint_every=2",
        "train.micro_batch=4",
        "train.tensorboard=true",
    )
    straight = _trainer(cfg)
    straight.fit()
    records = read_metrics(os.path.join(cfg.train.out_dir, "metrics.jsonl"))
    assert isinstance(straight.train_data, MixedBatches)
    for r in records:  # each source's tokens so far, as the sampler counts them; they add up to every token trained
        assert r["source_tokens"] == straight.train_data.source_tokens(r["consumed_samples"])
        assert sum(r["source_tokens"].values()) == r["consumed_samples"] * 32
    assert [sorted(r.get("source_val_loss", {})) for r in records] == [[], ["a", "b", "c"], [], ["a", "b", "c"]]
    assert records[1]["val_loss"] == pytest.approx(
        sum(w * records[1]["source_val_loss"][n] for n, w in zip("abc", WEIGHTS)), rel=1e-12
    )
    losses = [r["loss"] for r in records]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(cfg.train.out_dir, "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("source_tokens/c")] == [r["source_tokens"]["c"] for r in records]
    assert [e.value for e in events.Scalars("source_val_loss/b")] == pytest.approx(
        [r["source_val_loss"]["b"] for r in records if "source_val_loss" in r], rel=1e-6
    )

    resumed = _trainer(_mixture(d, tmp_path / "resumed", "train.micro_batch=4"))
    resumed.load_checkpoint(os.path.join(cfg.train.out_dir, "checkpoints", "step_000002"))  # written by fit()
    expected = straight.train_data.micro_batches(16, 8, 4)
    for got, want in zip(resumed.train_data.micro_batches(resumed.consumed, 8, 4), expected):
        assert all(g.equal(w) for g, w in zip(got, want))
    assert _steps(resumed, 2) == losses[2:]  # bitwise, as a plain resume is

    (path, rank0), (_, rank1) = run_ranks(2, _dp2_checkpoint, d, str(tmp_path / "dp2"), timeout=300)
    for got, want in ((rank0[0], expected[0]), (rank1[0], expected[1])):  # dp2's rows together are dp1's batch
        assert all(g.equal(w) for g, w in zip(got, want))
    one = _trainer(_mixture(d, tmp_path / "dp1", "train.micro_batch=4"))
    one.load_checkpoint(path)
    assert one.consumed == 16
    for got, want in zip(one.train_data.micro_batches(one.consumed, 8, 4), expected):
        assert all(g.equal(w) for g, w in zip(got, want))
    assert _steps(one, 2) == pytest.approx(losses[2:], rel=1e-5)  # dp2's gradient mean, rounded otherwise
