"""train.compile=true compiles the blocks and trains to the same losses as eager execution; its greedy sample is the
eager trainer's, token for token."""

import torch

from helpers import tiny_config
from trickles.topology import ParallelDims
from trickles.train.trainer import Trainer

# micro-batches of 4 x 32: the shapes tests/distributed/test_layouts_misc.py compiles too (the graph cache is shared)
COMMON = ["train.micro_batch=4", "train.sample_temperature=0", "train.sample_top_k=0"]


def _trained(tmp, *overrides):
    trainer = Trainer(tiny_config(tmp, *COMMON, *overrides, steps=3), ParallelDims().build(torch.device("cpu")), quiet=True)
    return [trainer.train_step()["loss"] for _ in range(3)], trainer


def test_compiled_blocks_match_eager(tmp_path):
    eager_losses, eager = _trained(tmp_path)
    compiled_losses, compiled = _trained(tmp_path, "train.compile=true")
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled.model.layers.values())
    # measured: equal bit for bit (losses and weights) on CPU; the contract is fp32 layout invariance, 1e-4 and 1e-5
    for a, b in zip(compiled_losses, eager_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (compiled_losses, eager_losses)
    for (n, p), q in zip(compiled.model.named_parameters(), eager.model.parameters()):
        assert (p - q).abs().max() <= 1e-5, n
    # decoding: the compiled trainer runs its blocks eagerly (no recompilation for each length) and produces the eager
    # trainer's tokens exactly, greedily (after 3 steps that is mostly spaces) and sampled with the run's seed
    from torch._dynamo.utils import counters

    prompt = "def "
    graphs = counters["stats"]["unique_graphs"]
    greedy = compiled.sample(prompt, 16)
    assert greedy == eager.sample(prompt, 16)
    for trainer in (compiled, eager):
        trainer.cfg.train.sample_temperature = 1.0
    sampled = compiled.sample(prompt, 16)
    assert sampled == eager.sample(prompt, 16)
    assert counters["stats"]["unique_graphs"] == graphs
    new = compiled.tokenizer.encode(sampled[len(prompt):])
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
