"""train.compile=true: a compiled trainer decodes with its blocks run eagerly and gives the eager trainer's samples;
with the Triton kernels the compiled blocks train to the eager losses (without them, on two ZeRO-1 ranks:
tests/distributed/test_layouts_misc.py)."""

import torch
from helpers import tiny_config

from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

COMMON = ["train.micro_batch=4", "train.sample_temperature=0", "train.sample_top_k=0"]


def _trainer(tmp, *overrides):
    return Trainer(
        tiny_config(tmp, *COMMON, *overrides, steps=3), ParallelDims().build(torch.device("cpu")), quiet=True
    )


def _trained(tmp, *overrides):
    trainer = _trainer(tmp, *overrides)
    return [trainer.train_step()["loss"] for _ in range(3)], trainer


def test_a_compiled_trainer_samples_with_eager_blocks_and_the_eager_tokens(tmp_path):
    """Decoding runs the compiled trainer's blocks eagerly (no compilation for each length: Dynamo captures no graph)
    and produces the eager trainer's tokens exactly, greedily and sampled with the run's seed."""
    from torch._dynamo.utils import counters

    eager, compiled = _trainer(tmp_path), _trainer(tmp_path, "train.compile=true")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.model.layers.values())
    prompt = "def "
    graphs = counters["stats"]["unique_graphs"]
    greedy = compiled.sample(prompt, 16)
    assert greedy == eager.sample(prompt, 16)
    for trainer in (compiled, eager):
        trainer.cfg.train.sample_temperature = 1.0
    sampled = compiled.sample(prompt, 16)
    assert sampled == eager.sample(prompt, 16)
    assert counters["stats"]["unique_graphs"] == graphs
    new = compiled.tokenizer.encode(sampled[len(prompt) :])
    assert len(set(new)) > 4, new  # a varied continuation: equal tokens mean something here


def test_compiled_blocks_with_the_triton_kernels_match_eager(tmp_path):
    """``train.compile=true`` with ``model.kernels=triton`` (in Triton's interpreter here: tests/conftest.py sets
    TRITON_INTERPRET=1): Inductor compiles each block around the kernels' custom operators, nothing is traced into
    Triton, and three steps give the uncompiled run's losses within 1e-4 and its weights within 1e-5. (One sequence
    of 8 a step: the interpreter runs each kernel's programs -- one per row for the norms and rotary -- one by one in
    Python.)"""
    kernels = ["model.kernels=triton", "train.micro_batch=1", "train.global_batch=1", "data.seq_len=8"]
    eager_losses, eager = _trained(tmp_path, *kernels)
    compiled_losses, compiled = _trained(tmp_path, *kernels, "train.compile=true")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.model.layers.values())
    for a, b in zip(compiled_losses, eager_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (compiled_losses, eager_losses)
    for (n, p), q in zip(compiled.model.named_parameters(), eager.model.parameters()):
        assert (p - q).abs().max() <= 1e-5, n
