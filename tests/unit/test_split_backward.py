"""A stage's backward split into B (the input's gradient) and W (the weights'): together exactly the whole backward,
B touching no weight, W reaching the weights through autograd (their hooks fire), and the cases the split cannot
cut (a weight used twice along the input's path, a chunk without an input) still exact."""

import dataclasses
import threading

import pytest
import torch
from torch import nn

from trickles.memory.recompute import apply_recompute
from trickles.models.config import ModelConfig
from trickles.models.presets import apply_preset
from trickles.models.transformer import build_model
from trickles.parallel.pipeline.split import backward_input, backward_weight, phase
from trickles.parallel.pipeline.stages import StageChunk


def _whole_and_split(module, run, inp):
    """Gradients of the whole backward, then of B followed by W, on the same inputs."""
    module.zero_grad(set_to_none=True)
    run().backward()
    params = [p for p in module.parameters() if p.grad is not None]  # the ones this chunk uses
    whole = [p.grad.clone() for p in params], (inp.grad.clone() if inp is not None else None)
    module.zero_grad(set_to_none=True)
    if inp is not None:
        inp.grad = None
    out = run()
    deferred = backward_input(out, None, inp)
    untouched = all(p.grad is None for p in params)
    dx = inp.grad.clone() if inp is not None else None
    seen = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: seen.append(p)) for p in params]
    backward_weight(deferred)
    for h in hooks:
        h.remove()
    return whole, ([p.grad for p in params], dx), untouched, len(seen) == len(params)


@pytest.mark.parametrize("preset,recompute", [("tiny", "none"), ("tiny", "full"), ("gpt2-tiny", "selective")])
def test_b_then_w_is_the_whole_backward_exactly(preset, recompute):
    """A chunk of layers and the head with its loss (the last stage): the input's gradient from B and every weight's
    from W equal the whole backward bit for bit; B leaves every weight's .grad alone; W fires each weight's hook."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(apply_preset(ModelConfig(), preset), vocab_size=64, max_seq_len=16)
    model = build_model(cfg, 0)  # (Transformer(cfg) leaves some tables uninitialized: init_weights fills them)
    apply_recompute(model, recompute)
    chunk = StageChunk(model, list(range(cfg.n_layers)), False, True)
    x = torch.randn(2, 16, cfg.d_model, requires_grad=True)
    y = torch.randint(0, 64, (2, 16))
    (whole, whole_dx), (split, split_dx), untouched, hooked = _whole_and_split(model, lambda: chunk(x, 16, target=y), x)
    assert untouched and hooked
    assert torch.equal(whole_dx, split_dx)
    assert all(torch.equal(a, b) for a, b in zip(whole, split))


class _Reused(nn.Module):
    """One linear applied twice in a row: its weight is reached along the input's path twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return (self.lin(torch.tanh(self.lin(x))) * self.norm).square().sum()


def test_a_weight_used_twice_along_the_input_path_is_counted_once():
    torch.manual_seed(0)
    m, x = _Reused(), torch.randn(4, 8, requires_grad=True)
    (whole, whole_dx), (split, split_dx), untouched, hooked = _whole_and_split(m, lambda: m(x), x)
    assert untouched and hooked and torch.allclose(whole_dx, split_dx)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(whole, split))


def test_a_chunk_without_an_input_runs_its_whole_backward_in_w():
    """The first stage reads token ids: B has nothing to compute, W is the whole backward."""
    torch.manual_seed(0)
    emb = nn.Embedding(16, 8)
    ids = torch.randint(0, 16, (4,))
    (whole, _), (split, _), untouched, hooked = _whole_and_split(emb, lambda: emb(ids).square().sum(), None)
    assert untouched and hooked and all(torch.equal(a, b) for a, b in zip(whole, split))


class _Phased(torch.autograd.Function):
    """``y = x w``, recording which backward phase it ran in and computing only what that phase asks."""

    calls: list = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        step = phase()
        seen = []  # as a CUDA device thread of the autograd engine would see it
        helper = threading.Thread(target=lambda: seen.append(phase()))
        helper.start()
        helper.join()
        _Phased.calls.append((step, seen[0]))
        return (None if step == "weight" else g * w), (None if step == "input" else (g * x).sum(0))


def test_functions_computing_both_gradients_are_told_the_phase():
    """B runs such a function as ``input``, W as ``weight`` -- seen from any thread, as the engine's device threads
    run the nodes on CUDA; a plain backward as neither."""
    w = nn.Parameter(torch.full((3,), 2.0))
    x = torch.randn(5, 3, requires_grad=True)
    _Phased.calls = []
    deferred = backward_input(_Phased.apply(x, w).sum(), None, x)
    backward_weight(deferred)
    assert _Phased.calls == [("input", "input"), ("weight", "weight")] and phase() is None
    assert torch.equal(x.grad, torch.full((5, 3), 2.0)) and torch.allclose(w.grad, x.detach().sum(0))
