"""Configuration loading, overrides, and the table of bad inputs with their messages."""

import dataclasses
import glob
import os
import sys

import pytest

from trickles.config import Config, describe_keys
from trickles.errors import ConfigError
from trickles.topology import ParallelDims

REQUIRED_KEYS = [
    "model.flavor",
    "model.n_layers",
    "model.d_model",
    "model.n_heads",
    "model.n_kv_heads",
    "data.seq_len",
    "train.steps",
    "train.seed",
    "train.global_batch",
    "train.micro_batch",
    "train.lr",
    "train.out_dir",
    "parallel.dp",
    "parallel.tp",
    "parallel.pp",
    "memory.precision",
]


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
    (
        ["train.global_batch=30", "train.micro_batch=4"],
        2,
        "train.global_batch (30) must equal train.micro_batch (4) x accumulation x parallel.dp (2)",
    ),
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
    # found by the refusal audit (docs/testing.md, "Refusals")
    # [model] (trickles/models/config.py ModelConfig.validate)
    (["model.n_layers=0"], 1, "model.n_layers must be at least 1, got 0"),
    (["model.head_size=0"], 1, "model.head_size must be at least 1 or none"),
    (
        ["model.d_model=96", "model.n_heads=4", "model.n_kv_heads=4", "model.head_size=5"],
        1,
        "rotary embeddings need an even head size, but the head size is 5",
    ),
    (["model.dropout=1.0"], 1, "model.dropout must be in [0, 1), got 1.0"),
    (["model.vocab_size=1"], 1, "model.vocab_size must be at least 2, got 1"),
    (["model.moe_experts=4", "model.moe_ffn_hidden=0"], 1, "model.moe_ffn_hidden must be at least 1, got 0"),
    (
        ["model.moe_experts=4", "model.moe_top_k=1", "model.moe_router=hard", "model.moe_label_experts=[a:0, a:1]"],
        1,
        "model.moe_label_experts names a label twice",
    ),
    (["model.max_seq_len=0", "data.seq_len=1"], 1, "model.max_seq_len must be at least 1, got 0"),
    # [train] (trickles/train/config.py TrainConfig.validate)
    (["train.micro_batch=0"], 1, "train.micro_batch must be at least 1 or none, got 0"),
    (["train.min_lr_ratio=1.5"], 1, "train.min_lr_ratio must be in [0, 1], got 1.5"),
    (["train.warmup_steps=-1"], 1, "train.warmup_steps must not be negative, got -1"),
    (["train.keep_checkpoints=0"], 1, "train.keep_checkpoints must be at least 1, got 0"),
    (["train.eps=0"], 1, "train.eps must be positive"),
    (["train.poly_power=0"], 1, "train.poly_power must be positive, got 0"),
    (["train.trust_coefficient=0"], 1, "train.trust_coefficient must be positive"),
    (["train.sample_temperature=-1"], 1, "train.sample_temperature must not be negative, got -1"),
    # [data] (trickles/data/config.py DataConfig.validate)
    (["data.val_fraction=1"], 1, "data.val_fraction must be in [0, 1), got 1.0"),
    (["data.bpe_vocab_size=258"], 1, "data.bpe_vocab_size must be at least 259"),
    (["data.max_bytes=0"], 1, "data.max_bytes must be positive or none, got 0"),
    # [parallel] (trickles/parallel/config.py ParallelConfig.validate, trickles/topology.py)
    (["parallel.zero=4"], 1, "parallel.zero must be 0, 1, 2 or 3, got 4"),
    (["parallel.schedule=zigzag"], 1, "parallel.schedule must be one of"),
    (["parallel.virtual_stages=0"], 1, "parallel.virtual_stages must be at least 1, got 0"),
    (["parallel.tp_mode=4d"], 1, "parallel.tp_mode must be one of 1d, 2d, 2.5d, 3d, got '4d'"),
    (["parallel.tp_mode=2.5d", "parallel.tp_depth=0"], 1, "parallel.tp_depth must be at least 1, got 0"),
    (["parallel.tp_mode=2d", "parallel.tp=4", "parallel.tp_depth=2"], 4, "with tp_mode=2d leave it at 1"),
    (["parallel.dp=0"], 1, "parallel.dp must be a positive integer, got 0"),
    # combinations (trickles/config.py Config.validate and its _check_* helpers)
    (["parallel.ep=2"], 2, "parallel.ep=2 splits the experts of mixture-of-experts blocks, but model.moe_experts is 0"),
    (["model.moe_experts=3", "parallel.ep=2"], 2, "model.moe_experts (3) must be divisible by parallel.ep (2)"),
    (["memory.offload_optimizer=true"], 1, "memory.offload_optimizer needs a sharded optimizer"),
    (["parallel.zero=3", "train.compile=true"], 1, "train.compile does not work with parallel.zero=3"),
    (["memory.loss_scale=0"], 1, "memory.loss_scale and memory.loss_scale_min must be positive"),
    (["memory.loss_scale_min=0"], 1, "memory.loss_scale and memory.loss_scale_min must be positive"),
    # elementwise recomputation's recipes cover dense blocks' norms and activations on 1-D layouts, in eager mode
    (
        ["memory.recompute=elementwise", "model.moe_experts=4"],
        1,
        "memory.recompute=elementwise does not combine with mixture-of-experts blocks (model.moe_experts); "
        "set model.moe_experts=0",
    ),
    (
        ["model.final_softcap=30", "parallel.tp=4", "parallel.tp_mode=2d"],
        4,
        "(1 + w) norms or final-logit soft-capping (model.norm_unit_offset, model.final_softcap) does not combine "
        "with parallel.tp_mode=2d",
    ),
    (
        ["memory.recompute=elementwise", "parallel.tp=4", "parallel.tp_mode=2d"],
        4,
        "memory.recompute=elementwise does not combine with parallel.tp_mode=2d; use parallel.tp_mode=1d",
    ),
    (
        ["memory.recompute=elementwise", "train.compile=true"],
        1,
        "memory.recompute=elementwise does not combine with train.compile (its partitioner chooses what to recompute)",
    ),
    # a partial full recomputation (memory.recompute_num_layers)
    (
        ["memory.recompute=full", "memory.recompute_num_layers=-1"],
        1,
        "memory.recompute_num_layers must not be negative, got -1",
    ),
    (
        ["memory.recompute_num_layers=1"],
        1,
        "memory.recompute_num_layers counts the layers memory.recompute=full recomputes whole, "
        "but memory.recompute is none",
    ),
    (
        ["memory.recompute_rest=selective"],
        1,
        "memory.recompute_rest applies to the layers memory.recompute_num_layers leaves out",
    ),
    (
        ["memory.recompute=full", "memory.recompute_num_layers=1", "parallel.tp=4", "parallel.tp_mode=2d"],
        4,
        "memory.recompute_num_layers does not combine with parallel.tp_mode=2d; use parallel.tp_mode=1d",
    ),
    (
        [
            "memory.recompute=full",
            "memory.recompute_num_layers=1",
            "memory.recompute_rest=elementwise",
            "model.moe_experts=4",
        ],
        1,
        "memory.recompute_rest=elementwise does not combine with mixture-of-experts blocks (model.moe_experts); set "
        "model.moe_experts=0 or use memory.recompute_rest=selective (or none)",
    ),
    (["model.vocab_size=256"], 1, "model.vocab_size (256) is smaller than the byte tokenizer's 257 tokens"),
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel needs parallel.tp > 1"),
    (["parallel.tp=2", "model.ffn_hidden=129"], 2, "the MLP width (129) must be divisible by parallel.tp (2)"),
    (
        ["parallel.tp=2", "model.vocab_size=301"],
        2,
        "the vocabulary (model.vocab_size = 301) must be divisible by parallel.tp (2)",
    ),
    (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=255"],
        2,
        "data.seq_len (255) must be divisible by parallel.tp (2) for sequence parallelism",
    ),
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
    "gpt2_bpe.toml": (
        1,
        dict(dp=1, tp=1, pp=1),
        (8, 2),
    ),  # "two accumulation micro-steps per optimizer step on one rank"
    "llama_125m_gpu.toml": (2, dict(dp=2, tp=1, pp=1), (16, 2)),  # "one or more GPUs": data parallel over them
    "pipeline_parallel.toml": (
        4,
        dict(dp=1, tp=2, pp=2),
        (2, 8),
    ),  # "2 pipeline stages x 2 tensor-parallel ranks", "8 micro-batches"
    "tensor_parallel.toml": (
        4,
        dict(dp=2, tp=2, pp=1),
        (8, 1),
    ),  # "2 data-parallel replicas x 2 tensor-parallel ranks", "8 sequences per replica"
}


@pytest.mark.parametrize(
    "path",
    sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "*.toml"))),
    ids=os.path.basename,
)
def test_every_example_has_the_layout_its_comment_states(path):
    name = os.path.basename(path)
    assert name in EXAMPLES, f"examples/{name} has no expected layout in EXAMPLES; add one from its comment"
    world, degrees, plan = EXAMPLES[name]
    text = open(path).read()
    for command in ("--nproc ", "--nproc-per-node "):  # the launch commands the file shows use that many ranks
        for stated in text.split(command)[1:]:
            assert stated.split()[0] in (str(world), "N"), (
                f"{name} says {command}{stated.split()[0]}, the table {world}"
            )
    cfg = Config.load(path, [])
    dims = cfg.validate(world)
    assert {k: getattr(dims, k) for k in degrees} == degrees and dims.cp == dims.ep == 1
    assert cfg.batch_plan(dims.dp) == plan


def test_elementwise_and_partial_recomputation_validate_on_1d_tensor_parallelism():
    """The grids' refusals leave 1-D tensor parallelism (with sequence parallelism) alone; each pipeline rank counts its
    own first layers, in the order it runs its chunks."""
    for sets in (
        ["memory.recompute=elementwise"],
        ["memory.recompute=full", "memory.recompute_num_layers=1", "memory.recompute_rest=elementwise"],
    ):
        Config.load(None, [*sets, "parallel.tp=2", "parallel.sequence_parallel=true"]).validate(2)
    cfg = Config.load(
        None,
        [
            "memory.recompute=full",
            "memory.recompute_num_layers=1",
            "model.n_layers=4",
            "parallel.pp=2",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            "train.global_batch=4",
            "train.micro_batch=1",
        ],
    )
    # rank 0 runs layers 0 and 2 (virtual stages 0 and 2), rank 1 layers 1 and 3
    assert cfg.recompute_modes(cfg.validate(2)) == {0: "full", 1: "full", 2: "none", 3: "none"}


def test_the_zb_v_schedule_implies_its_two_chunks():
    """``parallel.schedule=zb-v`` always places two chunks on a rank: unset, ``virtual_stages`` is 2 (and 1 for every
    other schedule); 2 given is accepted, any other value refused in one line that says what to change."""
    base = ["parallel.pp=2", "model.n_layers=4", "train.global_batch=4", "train.micro_batch=1"]
    cfg = Config.load(None, [*base, "parallel.schedule=zb-v"])
    assert cfg.parallel.virtual_stages == 2 and cfg.validate(2).pp == 2
    assert Config.load(None, [*base, "parallel.schedule=zb-v", "parallel.virtual_stages=2"]) == cfg
    assert Config.load(None, base).parallel.virtual_stages == 1 and Config().parallel.virtual_stages == 1
    assert Config.load(None, ["parallel.schedule=zb-v"]).validate(1).pp == 1  # one stage: the schedule is moot
    for v in (1, 3):
        with pytest.raises(ConfigError) as e:
            Config.load(None, [*base, "parallel.schedule=zb-v", f"parallel.virtual_stages={v}"]).validate(2)
        assert "\n" not in str(e.value)
        assert f"leave parallel.virtual_stages unset or set parallel.virtual_stages=2 (got {v})" in str(e.value)
    assert "unset: the schedule's own, 2 for zb-v" in describe_keys()


def test_train_plot_without_matplotlib_says_so_once(tmp_path, monkeypatch, capsys):
    """``train.plot`` is on by default; without matplotlib the run's plots are not drawn, and the run says so in one
    ``warning:`` line on stderr (once, however many plots it skips) with what to do, instead of nothing."""
    from trickles.train import metrics

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 2.0, "moe_load": {"0": [3, 1]}}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    said = getattr(metrics, "_say_no_matplotlib", None)
    if said is not None:
        said.cache_clear()  # said earlier in this process, it would not be said again
    assert metrics.plot_loss(str(log), str(tmp_path / "loss.png")) is False
    assert metrics.plot_expert_load(str(log), str(tmp_path / "expert_load.png")) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning: train.plot=true, but matplotlib is not installed" in err[0]
    assert "pip install 'trickles[plots]'" in err[0] and "train.plot=false" in err[0]
    assert not (tmp_path / "loss.png").exists()
