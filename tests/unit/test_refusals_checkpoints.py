"""Every refusal of a checkpoint is pinned: one that is missing or damaged (manifest, trainer.json, tensor files,
tokenizer), one whose tensors do not fit its model, one written by another model or optimizer, one of the wrong kind
(int8 where float is needed and back), and the commands' bad arguments about them (docs/testing.md, "Refusals").

One tiny checkpoint (one step) is trained per module; each test damages its own copy. A damage behind the manifest's
back is followed by rewriting the manifest, so that the check under test -- not the checksum -- is what refuses it."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from helpers import tiny_config, trained_checkpoint

from trickles.errors import CheckpointError, ConfigError, UserError
from trickles.topology import ParallelDims
from trickles.train import checkpoint as ckpt
from trickles.train.export import export_checkpoint
from trickles.train.trainer import Trainer


def _raises(exc, message):
    return pytest.raises(exc, match=re.escape(message))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny run's out_dir and its step checkpoint."""
    tmp = tmp_path_factory.mktemp("run")
    return str(tmp), trained_checkpoint(str(tmp), 1, "data.max_bytes=30000")


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    from trickles.compress import quantize_checkpoint

    return quantize_checkpoint(source[1], str(tmp_path_factory.mktemp("q") / "int8"))


@pytest.fixture
def copy(source, tmp_path):
    """A copy of the checkpoint to damage: ``(step dir, edit)`` with ``edit(fn)`` changing trainer.json and rewriting
    the manifest."""
    path = str(tmp_path / "step_000001")
    shutil.copytree(source[1], path)

    def edit(fn):
        meta = json.loads(open(os.path.join(path, "trainer.json")).read())
        fn(meta)
        ckpt.write_json(os.path.join(path, "trainer.json"), meta)
        ckpt.write_manifest(path)

    return path, edit


def _trainer(tmp, *overrides):
    return Trainer(tiny_config(str(tmp), *overrides, steps=1), ParallelDims().build(torch.device("cpu")), quiet=True)


# ---- missing or damaged -----------------------------------------------------------------------------------------


def test_a_missing_checkpoint_or_a_damaged_manifest_is_refused(copy, tmp_path):
    path, _ = copy
    with _raises(CheckpointError, "does not exist; give a checkpoint directory or a run's out_dir"):
        ckpt.verify(str(tmp_path / "step_000009"))
    os.remove(os.path.join(path, "tokenizer", os.listdir(os.path.join(path, "tokenizer"))[0]))
    with _raises(CheckpointError, "is missing; resume from an earlier checkpoint"):
        ckpt.verify(path)
    with open(os.path.join(path, ckpt.MANIFEST), "w") as f:
        f.write("{")
    with _raises(CheckpointError, "is not a valid manifest; the checkpoint is damaged"):
        export_checkpoint(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_missing_or_damaged_trainer_json_is_refused(copy, tmp_path):
    path, _ = copy
    meta = os.path.join(path, "trainer.json")
    with open(meta, "w") as f:
        f.write("{not json")
    ckpt.write_manifest(path)
    with _raises(CheckpointError, "trainer.json is not valid JSON"):
        export_checkpoint(path, str(tmp_path / "out"))
    os.remove(meta)
    ckpt.write_manifest(path)
    with _raises(CheckpointError, "trainer.json is missing"):
        export_checkpoint(path, str(tmp_path / "out"))


def test_missing_or_unreadable_tensor_files_are_refused(copy, tmp_path):
    path, _ = copy
    model_file = os.path.join(path, "model-rank00000.safetensors")
    with open(model_file, "wb") as f:
        f.write(b"not safetensors")
    ckpt.write_manifest(path)
    with _raises(CheckpointError, f"cannot read {model_file}: "):
        export_checkpoint(path, str(tmp_path / "out"))
    os.remove(model_file)
    ckpt.write_manifest(path)
    with _raises(CheckpointError, "has no model*.safetensors files"):
        export_checkpoint(path, str(tmp_path / "out"))


def test_pieces_that_do_not_cover_what_is_asked_are_refused(tmp_path):
    from trickles.train.pieces import PieceReader, save_pieces

    save_pieces(
        {"w": (torch.zeros(2, 4), {"global_shape": [4, 4], "offset": [2, 0], "block_shape": [2, 4]})},
        str(tmp_path / "model-rank00000.safetensors"),
    )
    with _raises(CheckpointError, "the checkpoint holds no piece of w covering the part asked for; it is incomplete"):
        PieceReader(str(tmp_path), "model").read("w", ((0, 0), (2, 4)))


def test_a_checkpoint_without_its_tokenizer_is_refused(copy, tmp_path):
    path, _ = copy
    shutil.rmtree(os.path.join(path, "tokenizer"))
    ckpt.write_manifest(path)
    with _raises(CheckpointError, "has no tokenizer/ directory; it is incomplete"):
        export_checkpoint(path, str(tmp_path / "out"))
    with _raises(CheckpointError, "has no tokenizer/ directory; it is incomplete"):
        ckpt.write_model_dir(str(tmp_path / "model"), {}, os.path.join(path, "tokenizer"), {})
    assert not os.path.exists(tmp_path / "model") and not os.path.exists(tmp_path / "model.tmp")


# ---- tensors that do not fit the model, another model or optimizer ----------------------------------------------


def test_tensors_that_do_not_fit_the_recorded_model_are_refused(copy, tmp_path):
    path, edit = copy
    edit(lambda meta: meta["model"].update(n_layers=1))
    with _raises(CheckpointError, "does not fit this model: missing [], unexpected ['layers.1."):
        export_checkpoint(path, str(tmp_path / "out"))
    edit(lambda meta: meta["model"].update(n_layers=2, ffn_hidden=96))
    with _raises(CheckpointError, "has shape (128, 64), the model expects (96, 64)"):
        export_checkpoint(path, str(tmp_path / "out"))


def test_init_from_a_checkpoint_without_a_model_config_is_refused(copy):
    path, edit = copy
    edit(lambda meta: meta.pop("model"))
    with _raises(CheckpointError, "trainer.json holds no model config; give a checkpoint trickles wrote"):
        tiny_config(os.path.dirname(path), f"train.init_from={path}").validate(1)


def test_resuming_a_checkpoint_of_another_model_is_refused(source, tmp_path):
    with _raises(CheckpointError, "was written by a different model (model.n_layers: checkpoint 2 vs now 3)"):
        _trainer(tmp_path, "model.n_layers=3").load_checkpoint(source[1])


def test_a_sharded_optimizer_refuses_the_state_of_another_optimizer(source, tmp_path):
    """The trainer refuses a checkpoint whose trainer.json names another optimizer; the sharded optimizer refuses the
    state itself when it is another optimizer's (Adam's moments where LARS keeps momentum), whatever the json says."""
    tr = _trainer(tmp_path, "parallel.zero=1", "train.optimizer=lars")
    with _raises(CheckpointError, "the checkpoint holds exp_avg for"):
        tr.engine.load(source[1])


# ---- export -----------------------------------------------------------------------------------------------------


def test_export_refuses_an_unknown_format_an_out_inside_the_source_and_an_out_that_appears(
    source, tmp_path, monkeypatch
):
    from trickles.train import export

    path = source[1]
    with _raises(UserError, "unknown export format 'onnx'; choose trickles or hf"):
        export_checkpoint(path, str(tmp_path / "out"), fmt="onnx")
    with _raises(CheckpointError, "lies inside the checkpoint it exports; choose a path outside"):
        export_checkpoint(path, os.path.join(path, "inside"))
    out = str(tmp_path / "raced")
    monkeypatch.setattr(export, "_write_single_process", lambda *a: os.makedirs(out))  # another process wrote it
    with _raises(CheckpointError, "appeared while exporting; choose another path or delete it"):
        export_checkpoint(path, out)


def test_hf_export_refuses_a_tokenizer_file_that_would_overwrite_the_models(copy, tmp_path):
    path, _ = copy
    with open(os.path.join(path, "tokenizer", "config.json"), "w") as f:
        f.write("{}")
    ckpt.write_manifest(path)
    with _raises(CheckpointError, "the tokenizer's config.json would overwrite the model's"):
        export_checkpoint(path, str(tmp_path / "out"), fmt="hf")
    assert not os.path.exists(tmp_path / "out")


# ---- int8 and float ---------------------------------------------------------------------------------------------


def test_quantization_refuses_bad_arguments_and_the_wrong_kind_of_checkpoint(source, quantized, tmp_path):
    from trickles.compress import float_model, load_checkpoint, quantize_checkpoint
    from trickles.infer import load_streaming

    path = source[1]
    with _raises(UserError, "--granularity must be row or tensor, got 'column'"):
        quantize_checkpoint(path, str(tmp_path / "q"), granularity="column")
    with _raises(UserError, "int8 must be weight or full, got 'half'"):
        load_checkpoint(path, int8="half")
    with _raises(CheckpointError, "is already quantized; give the float checkpoint it came from"):
        quantize_checkpoint(quantized, str(tmp_path / "q"))
    with _raises(CheckpointError, "is quantized; give a float checkpoint"):
        float_model(quantized)
    with _raises(UserError, "is not quantized, so --int8 does not apply"):
        load_streaming(path, "cpu", 10**9, int8="weight")


# ---- compress report, prune, distill ----------------------------------------------------------------------------


def test_compress_report_refuses_bad_arguments_and_checkpoints_it_cannot_compare(source, tmp_path, monkeypatch):
    from trickles.compress import report

    with _raises(UserError, "give at least one checkpoint to report on"):
        report.compress_report([])
    with _raises(UserError, "--tokens must be at least 1, got 0"):
        report.compress_report([source[1]], tokens=0)
    with _raises(UserError, "does not exist; give a checkpoint directory or a run's out_dir"):
        report.load_model(str(tmp_path / "nowhere"))
    model, tokenizer, meta, _ = report.load_model(source[1])
    no_val = {**meta, "config": {**meta["config"], "data": {**meta["config"]["data"], "val_fraction": 0.0}}}
    with _raises(UserError, "the run's held-out split has 0 tokens, fewer than one sequence"):
        report.calibration_batches(no_val, tokenizer, "val", 1)

    class Wider:  # the second checkpoint reads another tokenizer's ids
        vocab_size = tokenizer.vocab_size + 1

    loaded = report.load_model
    monkeypatch.setattr(report, "load_model", lambda p: loaded(p) if p == source[1] else (model, Wider(), meta, p))
    with _raises(UserError, f"other has a tokenizer of {Wider.vocab_size} tokens"):
        report.compress_report([source[1], "other"], tokens=1, batches=1)


def test_prune_refuses_bad_arguments_and_models_it_cannot_prune(source, tmp_path):
    from trickles.compress.prune import check_prunable, measure, plan, prune_checkpoint
    from trickles.models import ModelConfig, build_model

    with _raises(UserError, "--score must be taylor or activation, got 'magnitude'"):
        prune_checkpoint(source[1], str(tmp_path / "p"), score="magnitude")
    with _raises(UserError, "--batches must be at least 1, got 0"):
        prune_checkpoint(source[1], str(tmp_path / "p"), batches=0)
    with _raises(UserError, "pruning mixture-of-experts models is not supported"):
        check_prunable(ModelConfig(moe_experts=2))
    cfg = ModelConfig(
        n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32, max_seq_len=8, fused_proj=False
    )
    with _raises(UserError, "unknown importance score 'magnitude'; choose taylor or activation"):
        measure(build_model(cfg, seed=0), [], score="magnitude")
    with _raises(ValueError, "measure() needs a model with separate q/k/v and gate/up projections"):
        measure(build_model(ModelConfig(**{**cfg.__dict__, "fused_proj": True}), seed=0), [])
    with _raises(UserError, "--heads and --ffn are fractions to remove, in [0, 1); got 1 and 0"):
        plan(None, cfg, heads=1.0)
    with _raises(UserError, "--multiple-of must be at least 1, got 0"):
        plan(None, cfg, multiple_of=0)


def test_distillation_refuses_a_teacher_it_cannot_load_or_pair_with(source, tmp_path):
    from trickles.compress.config import DistillConfig
    from trickles.compress.distill import Distiller, load_teacher
    from trickles.train.load import load_for_inference

    with _raises(ConfigError, "nowhere does not exist; give a trickles checkpoint, a run's out_dir or a Hugging Face"):
        load_teacher(str(tmp_path / "nowhere"))
    with _raises(ConfigError, "distill.teacher: no complete checkpoint found at"):
        load_teacher(str(tmp_path))
    student = load_for_inference(source[1])[0].cfg
    with _raises(ConfigError, "distill.layer_map pair 5:0 names a block the student (2 blocks) or the teacher (2)"):
        Distiller(DistillConfig(teacher=source[1], hidden_weight=1.0, layer_map=["5:0"]), student, "cpu", seed=0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["distill.alpha=1.5"], "distill.alpha must be in [0, 1], got 1.5"),
        (["distill.temperature=0"], "distill.temperature must be positive, got 0"),
        (["distill.hidden_weight=-1"], "distill.hidden_weight must be 0 or more, got -1"),
        (["distill.layer_map=[0-1]"], "distill.layer_map entry '0-1' is not 'student:teacher'"),
        (["distill.layer_map=[0:x]"], "distill.layer_map entry '0:x' is not 'student:teacher'"),  # a ':' is not enough
    ],
)
def test_bad_distillation_settings_are_refused(source, overrides, message):
    with _raises(ConfigError, message):
        tiny_config(source[0], f"distill.teacher={source[1]}", *overrides).validate(1)
