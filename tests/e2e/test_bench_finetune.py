"""``benchmarks/finetune.py`` at a tiny size, in this process: both parts (our LoRA step against transformers + peft,
our full-parameter SFT step against transformers') pass their agreement checks and time one round each; a peer that
computes something else stops the run before any timing."""

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("peft", exc_type=ImportError)

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "finetune.py")
_spec = importlib.util.spec_from_file_location("finetune_benchmark", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = ["--layers", "1", "--d-model", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "512"]
ONE_ROUND = ["--seq", "48", "--rank", "4", "--steps", "1", "--warmup", "0", "--repeats", "1", "--memory", "none"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model's directory, written by the first run and read by the next."""
    return str(tmp_path_factory.mktemp("finetune") / "model")


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_both_parts_agree_with_their_peers_then_time_a_round(tmp_path, model_dir, capsys):
    out = tmp_path / "finetune.json"
    args = [*TINY, *ONE_ROUND, "--dir", model_dir, "--json", str(out)]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "lora: ours/peft step time" in printed and "sft: ours/transformers step time" in printed
    doc = json.loads(out.read_text())
    for part, peer in (("lora", "peft"), ("sft", "transformers")):
        check = doc[part]["check"]
        assert check["ok"] and len(check["losses"]["trickles"]) == 3
        assert check["losses"]["trickles"] == pytest.approx(check["losses"][peer], rel=1e-5)
        assert len(doc[part]["repeats"]) == 1 and doc[part]["ratio"] > 0
    assert doc["lora"]["trained_params"] < doc["sft"]["trained_params"]  # only the adapters train


def test_a_peer_computing_something_else_stops_the_run(model_dir, monkeypatch, capsys):
    build = bench.Peer.__init__

    def broken(self, *args, **kwargs):  # the peer's output head off by 1%
        build(self, *args, **kwargs)
        with torch.no_grad():
            self.model.get_output_embeddings().weight.mul_(1.01)

    monkeypatch.setattr(bench.Peer, "__init__", broken)
    args = [*TINY, *ONE_ROUND, "--part", "lora", "--dir", model_dir]
    assert bench.main(args) == 1
    assert "MISMATCH" in capsys.readouterr().out
