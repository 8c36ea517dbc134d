"""Layout invariance of multi-token prediction through the command line: a tiny model with ``model.mtp_depth=2``
trained 6 steps on one process, then on two pipeline stages (the prediction modules on the last, beside its copy of
the embedding and the micro-batches' input ids) and on two tensor-parallel ranks with sequence parallelism (the
prediction blocks split like the others) -- and, for the llama, on two data-parallel ranks under ZeRO-3 -- logs
the same per-step losses and saves the same final weights, the prediction modules' included, within 1e-4.

Two models: a llama on packed short documents (each depth's targets stop at its document's end) and a gpt2 (learned
positions and a tied output projection: the last stage's copies of both tables are tied to the first's). Every run
cuts the global batch into the same micro-batches: with packed documents the depths' trained targets differ from one
micro-batch to the next, and each depth's loss is a mean over its micro-batch's."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import final_weights, run_losses, short_documents

from trickles.testing import run_command

STEPS = 6
TOL = 1e-4

MODELS = {"llama-documents": ["model.preset=tiny", "data.document_mask=true"], "gpt2": ["model.preset=gpt2-tiny"]}
LAYOUTS = {
    "pp2": (2, ["parallel.pp=2"], "(dp=1, pp=2 "),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], "(dp=1, tp=2 with sequence parallel)"),
    "dp2-zero3": (2, ["parallel.zero=3"], "(dp=2, ZeRO-3)"),
}
CASES = [(m, lay) for m in MODELS for lay in LAYOUTS if lay != "dp2-zero3" or m == "llama-documents"]


def _train(tmp, out, ranks: int, settings: list[str]):
    sets = [
        *short_documents(tmp / "docs.jsonl"),
        "model.mtp_depth=2",
        "model.mtp_weight=0.3",
        "data.seq_len=32",
        f"data.cache_dir={tmp}/cache",
        f"train.steps={STEPS}",
        "train.global_batch=8",
        "train.micro_batch=2",  # the same micro-batches everywhere: each depth's mean is over its micro-batch's targets
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.plot=false",
        f"train.out_dir={out}",
        *settings,
    ]
    args = ["train", *(a for s in sets for a in ("--set", s))]
    if ranks > 1:
        args += ["--nproc", str(ranks)]
    r = run_command([sys.executable, "-m", "trickles", *args], text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


def _losses(out) -> list[float]:
    return run_losses(out, STEPS)


def _weights(out) -> dict[str, torch.Tensor]:
    return final_weights(out, STEPS)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """``model -> (one process's losses, its final weights)``, each made once, when first asked."""
    root = tmp_path_factory.mktemp("mtp")
    made = {}

    def get(model: str):
        if model not in made:
            out = root / f"{model}-one"
            _train(root, out, 1, MODELS[model])
            made[model] = root, _losses(out), _weights(out)
        return made[model]

    return get


@pytest.mark.parametrize("model,layout", CASES)
def test_layout_matches_one_process(references, model, layout):
    root, losses, weights = references(model)
    assert any(k.startswith("mtp.1.block.") for k in weights) and "mtp.0.eh_proj.weight" in weights
    ranks, settings, banner = LAYOUTS[layout]
    out = root / f"{model}-{layout}"
    r = _train(root, out, ranks, MODELS[model] + settings)
    assert banner in r.stdout, r.stdout[-2000:]
    got = _losses(out)
    assert max(abs(a - b) for a, b in zip(got, losses)) < TOL, (got, losses)
    assert losses[-1] < losses[0]
    mine = _weights(out)
    assert mine.keys() == weights.keys()
    worst = max((mine[k] - weights[k]).abs().max().item() for k in weights)
    assert worst < TOL, worst
