"""Elastic relayout (``parallel.elastic``): a run stopped on 4 ranks (dp2 x tp2) continues on 2 at the layout the
planner chose for them -- from the checkpoint, resharded, the data order unchanged -- with the losses of one process;
on 3 ranks the planner finds a valid layout too; without the flag a world the degrees do not fit is refused, naming it,
before any process group exists. The planner plans on the machines the run is on (the run's ``[cluster]``, else the
kind of device its ranks train on, a GPU faked here from its properties), once: rank 0's layout is every rank's,
whatever each rank sees of its machine."""

import dataclasses
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config
from test_fault import _with_fault

from trickles.commands import run_command
from trickles.config import Config
from trickles.errors import ConfigError
from trickles.planner.cluster_files import preset
from trickles.planner.elastic import DeviceKind, agreed_layout, cluster_for_device, fits, layout_for_world, run_cluster
from trickles.testing import run_ranks
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

SETTINGS = [
    "--set",
    "model.preset=tiny",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.max_bytes=120000",
    "--set",
    "train.global_batch=8",
    "--set",
    "train.warmup_steps=2",
    "--set",
    "train.lr=3e-3",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.sample_tokens=0",
    "--set",
    "train.plot=false",
    "--set",
    "train.checkpoint_every=3",
    "--set",
    "train.eps=1e-6",
    "--set",
    "parallel.dp=2",
    "--set",
    "parallel.tp=2",
]


def _train(tmp, nproc, *extra, env=None):
    cmd = [
        sys.executable,
        "-m",
        "trickles",
        "train",
        "--nproc",
        str(nproc),
        *SETTINGS,
        "--set",
        f"data.cache_dir={tmp}/cache",
        "--set",
        f"train.out_dir={tmp}/run",
        "--set",
        "train.steps=12",
        *extra,
    ]
    return run_command(cmd, text=True, timeout=300, env=env)


def test_a_run_stopped_on_four_ranks_continues_on_two_at_the_planners_layout(tmp_path):
    """The 12-step run loses a rank after step 6 (its checkpoint written: synchronous saves), is restarted on 2
    ranks."""
    env, _ = _with_fault(tmp_path, "kill", after=6)
    first = _train(tmp_path, 4, "--set", "train.async_checkpoint=false", env=env)
    assert first.returncode != 0 and "was killed by SIGKILL" in first.stderr, first.stderr[-2000:]
    refused = _train(tmp_path, 2, "--resume", "auto")
    assert refused.returncode == 2 and "set parallel.elastic=true" in refused.stderr, refused.stderr[-2000:]
    second = _train(tmp_path, 2, "--resume", "auto", "--set", "parallel.elastic=true")
    assert second.returncode == 0, second.stderr[-2000:]
    line = [x for x in second.stdout.splitlines() if "parallel.elastic" in x]
    assert len(line) == 1 and "does not fit 2 processes; training on" in line[0], second.stdout
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    assert sorted(losses) == list(range(1, 13))  # steps 7-12 continued from step 6's checkpoint
    one = Trainer(
        tiny_config(tmp_path / "one", "train.eps=1e-6", steps=12), ParallelDims().build(torch.device("cpu")), quiet=True
    )
    straight = [one.train_step()["loss"] for _ in range(12)]
    assert [losses[s] for s in range(1, 13)] == pytest.approx(straight, rel=1e-4)


def test_three_ranks_get_a_valid_layout_and_without_the_flag_the_world_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, "parallel.dp=2", "parallel.tp=2", "train.global_batch=12", "parallel.elastic=true")
    assert fits(cfg, 4) and not fits(cfg, 3)
    chosen, line = layout_for_world(cfg, 3)
    dims = chosen.validate(3)  # a layout of 3 that validates, the global batch kept
    assert dims.world_size == 3 and chosen.train.global_batch == 12 and "does not fit 3 processes" in line
    fixed = tiny_config(tmp_path, "parallel.dp=2", "parallel.tp=2")
    assert layout_for_world(fixed, 3) == (fixed, None)
    with pytest.raises(ConfigError, match="set parallel.elastic=true"):
        fixed.validate(3)


def test_the_plan_is_for_the_device_the_ranks_train_on(tmp_path):
    """A GPU (faked from what ``torch.cuda.get_device_properties`` gives) plans as the preset of its name with its own
    memory and multiprocessors, the launcher's ranks to a node; CPU ranks as this machine (``local``); the run's
    ``[cluster]`` table, when it has one, wins over both."""
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_520_809_984, multi_processor_count=132)
    cluster = cluster_for_device(DeviceKind.from_properties(h100), local_ranks=4)
    want = preset("dgx-h100")
    assert (cluster.device, cluster.peak_tflops_bf16, cluster.intra_node_gbps) == (
        "cuda",
        want.peak_tflops_bf16,
        want.intra_node_gbps,
    )
    assert cluster.device_memory_gib == pytest.approx(85_520_809_984 / 2**30) and cluster.sm_count == 132
    assert cluster.devices_per_node == 4 and "dgx-h100" in cluster.name
    h200 = cluster_for_device(DeviceKind("cuda", "NVIDIA H200", 139.8, 132))
    assert h200.peak_tflops_bf16 == want.peak_tflops_bf16 and h200.memory_bandwidth_gbps == 4800.0
    assert h200.device_memory_gib == 139.8
    a100 = cluster_for_device(DeviceKind("cuda", "NVIDIA A100-SXM4-40GB", 39.4, 108))
    assert a100.peak_tflops_bf16 == preset("dgx-a100").peak_tflops_bf16 and a100.device_memory_gib == 39.4
    other = cluster_for_device(DeviceKind("cuda", "NVIDIA L4", 22.0, 58))
    assert "unknown GPU" in other.name and (other.device_memory_gib, other.sm_count) == (22.0, 58)
    assert cluster_for_device(DeviceKind("cpu")) == preset("local")
    cfg = tiny_config(tmp_path, "parallel.elastic=true")
    assert run_cluster(cfg, 2, DeviceKind("cpu")) == preset("local")
    (tmp_path / "run.toml").write_text(
        '[parallel]\nelastic = true\n[cluster]\npreset = "dgx-h100"\ndevices_per_node = 4\n'
    )
    cfg = Config.load(tmp_path / "run.toml")
    assert run_cluster(cfg, 2, DeviceKind("cpu")) == dataclasses.replace(want, devices_per_node=4)


def _plan_with_this_ranks_view(cfg, views):
    """On each rank: the elastic layout of the pool's 2 ranks, this rank's view of the machines ``views[rank]``."""
    import torch.distributed as dist

    try:
        chosen, line = agreed_layout(cfg, 2, views[dist.get_rank()])
    except ConfigError as e:
        return str(e)
    return chosen.parallel, chosen.train.micro_batch, line


def test_every_rank_takes_rank_0s_layout_whatever_its_own_view(tmp_path):
    """Rank 1 sees a machine whose fastest layout differs (links a thousand times slower); both ranks train on rank 0's
    layout, and the line saying so is rank 0's. Where rank 0 finds no layout, both ranks stop with its message."""
    cfg = tiny_config(tmp_path, "parallel.dp=2", "parallel.tp=2", "parallel.elastic=true")
    views = [preset("local"), dataclasses.replace(preset("local"), intra_node_gbps=0.001, intra_node_latency_us=1e5)]
    mine = [layout_for_world(cfg, 2, view) for view in views]
    assert mine[0][0].parallel != mine[1][0].parallel  # the views disagree
    got = run_ranks(2, _plan_with_this_ranks_view, cfg, views)
    assert got[0] == got[1] == (mine[0][0].parallel, mine[0][0].train.micro_batch, mine[0][1])
    views = [dataclasses.replace(views[0], device_memory_gib=1e-6), views[0]]  # nothing fits rank 0's view
    refused = run_ranks(2, _plan_with_this_ranks_view, cfg, views)
    assert refused[0] == refused[1] and "no layout of 2 processes" in refused[0]
    fixed = tiny_config(tmp_path, "parallel.dp=2", "parallel.elastic=true")
    assert agreed_layout(fixed, 2) == (fixed, None)  # degrees that fit: nothing planned, no group needed
