"""Configuration loading, overrides, and the table of bad inputs with their messages."""

import dataclasses
import glob
import os

import pytest

from trickles.config import Config, describe_keys
from trickles.errors import ConfigError
from trickles.topology import ParallelDims

REQUIRED_KEYS = ["model.flavor", "model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads", "data.seq_len",
                 "train.steps", "train.seed", "train.global_batch", "train.micro_batch", "train.lr", "train.out_dir",
                 "parallel.dp", "parallel.tp", "parallel.pp", "memory.precision"]


def test_required_keys_exist_and_are_documented():
    cfg = Config()
    text = describe_keys()
    for key in REQUIRED_KEYS:
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key
        assert key in text


def test_toml_and_overrides(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[model]\npreset = "tiny"\nn_layers = 3\n[train]\nsteps = 7\nlr = 1e-3\n')
    cfg = Config.load(p, ["train.steps=9", "memory.precision=bf16", "model.n_kv_heads=none", "train.compile=true"])
    assert cfg.model.n_layers == 3 and cfg.model.d_model == 64  # preset, then explicit keys
    assert cfg.train.steps == 9 and cfg.train.lr == 1e-3
    assert cfg.memory.precision == "bf16" and cfg.model.n_kv_heads is None and cfg.train.compile is True


def test_round_trip_through_toml(tmp_path):
    cfg = Config.load(None, ["train.steps=3", "data.source=/x/y.txt", "model.preset=gpt2-tiny"])
    p = tmp_path / "c.toml"
    p.write_text(cfg.to_toml())
    assert Config.load(p) == cfg
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_batch_plan():
    cfg = Config.load(None, ["train.global_batch=32", "train.micro_batch=4"])
    assert cfg.batch_plan(2) == (4, 4)
    assert cfg.batch_plan(8) == (4, 1)
    assert Config.load(None, ["train.global_batch=32"]).batch_plan(4) == (8, 1)


BAD = [
    (["train.stpes=3"], "unknown key 'train.stpes'; did you mean 'train.steps'?"),
    (["trian.steps=3"], "unknown key 'trian'"),
    (["train.steps=abc"], "train.steps must be an integer, got 'abc'"),
    (["train.lr=fast"], "train.lr must be a number"),
    (["train.compile=maybe"], "train.compile must be true or false"),
    (["model.flavor=lama"], "did you mean 'llama'?"),
    (["memory.precision=fp8"], "memory.precision must be one of"),
    (["model.preset=llama-13b"], "unknown model.preset 'llama-13b'"),
    (["train.steps"], "must look like section.key=value"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_keys_and_types(overrides, message):
    with pytest.raises(ConfigError) as e:
        Config.load(None, overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


BAD_VALUES = [
    (["train.steps=0"], 1, "train.steps must be at least 1"),
    (["parallel.timeout_s=0"], 1, "parallel.timeout_s must be positive (seconds), got 0"),
    (["model.d_model=100", "model.n_heads=3"], 1, "model.d_model (100) must be divisible by model.n_heads (3)"),
    (["model.n_kv_heads=3"], 1, "must be a multiple of model.n_kv_heads (3)"),
    (["train.global_batch=30", "train.micro_batch=4"], 2, "train.global_batch (30) must equal train.micro_batch (4) x accumulation x parallel.dp (2)"),
    (["train.global_batch=15"], 2, "train.global_batch (15) must be divisible by parallel.dp (2)"),
    (["parallel.dp=2"], 4, "parallel.dp x tp x pp x cp = 2 x 1 x 1 x 1 = 2, but there are 4 processes"),
    (["parallel.tp=3"], 4, "4 processes cannot be split into parallel.tp x pp x cp = 3 x 1 x 1 = 3"),
    (["parallel.tp=0"], 1, "parallel.tp must be at least 1"),
    (["memory.loss_scale=0"], 1, "memory.loss_scale and memory.loss_scale_min must be positive"),
    (["train.max_nonfinite_steps=0"], 1, "train.max_nonfinite_steps must be at least 1"),
    (["data.seq_len=0"], 1, "data.seq_len must be at least 1"),
    (["model.max_seq_len=64", "data.seq_len=128"], 1, "data.seq_len (128) is longer than model.max_seq_len (64)"),
    (["train.lr=-1"], 1, "train.lr must be positive"),
    (["train.device=tpu"], 1, "train.device must be auto, cpu, cuda or cuda:N"),
]


@pytest.mark.parametrize("overrides,world,message", BAD_VALUES)
def test_impossible_values(overrides, world, message):
    cfg = Config.load(None, overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world)
    assert message in str(e.value)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.load(bad)
    bad.write_text("[train]\nsteps = 'ten'\n")
    with pytest.raises(ConfigError, match=r"train.steps must be an integer, got 'ten' \(in "):
        Config.load(bad)


def test_parallel_dims_validation_messages():
    ParallelDims(dp=2, tp=2).validate(4)
    with pytest.raises(ConfigError, match=r"set parallel.ep to one of \[1, 2, 4\]"):
        ParallelDims(dp=4, ep=3).validate(4)
    assert ParallelDims.infer(8, tp=2, pp=2) == ParallelDims(dp=2, tp=2, pp=2)


def test_mesh_coordinates_put_tp_innermost():
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert dims.coords(0) == dict(pp=0, dp=0, cp=0, tp=0, ep=0)
    assert dims.coords(1)["tp"] == 1 and dims.coords(2)["dp"] == 1 and dims.coords(4)["pp"] == 1
    assert dataclasses.astuple(dims) == (2, 2, 2, 1, 1, "1d", 1)  # dp, tp, pp, cp, ep, tp_mode, tp_depth


# Each example's layout, written out from what its header comment promises: (ranks, {degree: value}, (micro-batch,
# accumulation)). A new example needs a row here.
EXAMPLES = {
    "demo.toml": (1, dict(dp=1, tp=1, pp=1), (16, 1)),
    "gpt2_bpe.toml": (1, dict(dp=1, tp=1, pp=1), (8, 2)),  # "two accumulation micro-steps per optimizer step on one rank"
    "llama_125m_gpu.toml": (2, dict(dp=2, tp=1, pp=1), (16, 2)),  # "one or more GPUs": data parallel over them
    "pipeline_parallel.toml": (4, dict(dp=1, tp=2, pp=2), (2, 8)),  # "2 pipeline stages x 2 tensor-parallel ranks", "8 micro-batches"
    "tensor_parallel.toml": (4, dict(dp=2, tp=2, pp=1), (8, 1)),  # "2 data-parallel replicas x 2 tensor-parallel ranks", "8 sequences per replica"
}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "*.toml"))),
                         ids=os.path.basename)
def test_every_example_has_the_layout_its_comment_states(path):
    name = os.path.basename(path)
    assert name in EXAMPLES, f"examples/{name} has no expected layout in EXAMPLES; add one from its comment"
    world, degrees, plan = EXAMPLES[name]
    text = open(path).read()
    for command in ("--nproc ", "--nproc-per-node "):  # the launch commands the file shows use that many ranks
        for stated in text.split(command)[1:]:
            assert stated.split()[0] in (str(world), "N"), f"{name} says {command}{stated.split()[0]}, the table {world}"
    cfg = Config.load(path, [])
    dims = cfg.validate(world)
    assert {k: getattr(dims, k) for k in degrees} == degrees and dims.cp == dims.ep == 1
    assert cfg.batch_plan(dims.dp) == plan
