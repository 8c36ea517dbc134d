"""Every refusal of a command's options is pinned: one line ``error: ...`` on stderr, exit status 2, nothing on stdout
(docs/testing.md, "Refusals"). The commands run in this process (``helpers.cli_here``); where a refusal comes after the
checkpoint is loaded, the loaded model is a tiny one put in its place, and where it depends on the machine (torchrun,
CUDA, a package, a port) the machine is described to it, so every case runs on a CPU-only machine."""

from __future__ import annotations

import importlib.util
import socket
from types import SimpleNamespace

import pytest
import torch
from helpers import cli_here, tiny_config

from trickles.errors import ConfigError


def _refused(r, message):
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: {message}\n"), (r.returncode, r.stdout, r.stderr)


def _tiny_model():
    from trickles.data import ByteTokenizer
    from trickles.models import ModelConfig, build_model

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=260, max_seq_len=8)
    return build_model(cfg, seed=0).eval(), ByteTokenizer(), {}


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "{tmp}", "--temperature", "-1"], "--temperature must be a number >= 0 (0: greedy), got -1"),
        (
            ["generate", "{tmp}", "--beams", "2", "--length-penalty", "nan"],
            "--length-penalty must be a finite number, got nan",
        ),
        (["memory", "--measure", "-1"], "--measure must be 0 or more steps, got -1"),
    ],
)
def test_bad_options_are_refused(tmp_path, args, message):
    _refused(cli_here(*[a.format(tmp=tmp_path) for a in args], cwd=tmp_path), message)


def test_generate_refuses_cuda_where_there_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(
        cli_here("generate", tmp_path, "--device", "cuda"),
        "--device cuda: no CUDA device is available (torch.cuda.is_available() is false); use --device auto or cpu",
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["bench", "scaling"], "trickles bench starts its own local ranks; run it once, not under torchrun"),
        (["train", "--nproc", "2"], "--nproc starts local ranks itself; under torchrun leave it out"),
    ],
)
def test_commands_that_start_ranks_refuse_to_run_under_torchrun(tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    r = cli_here(*args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {message}") and r.stdout == "", r


def test_generate_refuses_a_label_for_a_model_without_hard_routed_experts(tmp_path, monkeypatch):
    import trickles.cli.generate as generate

    monkeypatch.setattr(generate, "load_model", lambda *a, **k: _tiny_model())
    _refused(
        cli_here("generate", tmp_path, "--label", "json", "--device", "cpu"),
        "--label is for models with hard-routed experts (model.moe_router=hard); this one has none",
    )


def test_serve_refuses_without_its_packages_for_a_hard_routed_model_and_on_a_busy_port(tmp_path, monkeypatch):
    import trickles.cli.serve as serve

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else find_spec(name, *a)
    )
    _refused(cli_here("serve", tmp_path), "trickles serve needs fastapi: pip install 'trickles[serve]'")
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    monkeypatch.setattr(serve, "context_length", lambda path: 8)
    hard = SimpleNamespace(cfg=SimpleNamespace(moe_experts=2, moe_router="hard"))
    monkeypatch.setattr(serve, "load_model", lambda *a, **k: (hard, None, {}))
    _refused(
        cli_here("serve", tmp_path, "--device", "cpu"),
        "this model routes its experts by label (model.moe_router=hard); trickles serve has no label field yet: "
        "use trickles generate --label L",
    )

    monkeypatch.setattr(serve, "load_model", lambda *a, **k: _tiny_model())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = cli_here("serve", tmp_path, "--device", "cpu", "--port", port)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port} (") and r.stderr.endswith(
        "); choose another --host or --port\n"
    ), r.stderr


# ---- CUDA asked for where there is none, or fewer GPUs than ranks (the machine described, not needed) ----------


def test_cuda_asked_for_without_cuda_is_refused(tmp_path, monkeypatch):
    from trickles.process import select_device
    from trickles.train.scaling import host

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"train.device asks for CUDA, but torch.cuda.is_available\(\) is false"):
        select_device("cuda")
    with pytest.raises(ConfigError, match=r"train.device asks for CUDA, but torch.cuda.is_available\(\) is false"):
        host(tiny_config(str(tmp_path), "train.device=cuda"))


def test_more_local_ranks_than_gpus_or_every_rank_on_one_gpu_is_refused(tmp_path, monkeypatch):
    from trickles.process import select_device
    from trickles.train import scaling

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError, match=r"2 ranks on this machine but 1 GPU\(s\) visible; launch at most 1 processes"
    ):
        select_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        ConfigError, match="train.device=cuda:0 puts every rank on one GPU; use train.device=cuda or auto"
    ):
        scaling.plan(tiny_config(str(tmp_path), "train.device=cuda:0"), [1, 2], 2, 1)
