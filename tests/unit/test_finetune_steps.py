"""What makes a fine-tuning step cheaper without changing it: a LoRA update added by one product (no ``[..., out]``
temporaries, the same gradients), and a loss mask's ignored positions skipped by the output projection."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trickles.adapters.lora import AddLowRank, add_low_rank
from trickles.kernels.cross_entropy import OutputLoss, cross_entropy


def _plain(y, h, a, b, s):
    return y + F.linear(F.linear(h, a), b) * s


def _run(fn, x, w, a, b, dy, autocast):
    for t in (x, a, b):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(F.linear(x, w), x, a, b, 2.0)
    out.backward(dy.to(out.dtype))
    return out.detach().float(), x.grad.clone(), a.grad.clone(), b.grad.clone()


@pytest.mark.parametrize("autocast", [False, True])
def test_low_rank_update_equals_the_two_linears_in_value_and_gradients(autocast):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g).requires_grad_()
    w = torch.randn(24, 16, generator=g)
    a = torch.randn(4, 16, generator=g).requires_grad_()
    b = torch.randn(24, 4, generator=g).requires_grad_()
    dy = torch.randn(2, 5, 24, generator=g)
    ours, ref = _run(add_low_rank, x, w, a, b, dy, autocast), _run(_plain, x, w, a, b, dy, autocast)
    for mine, theirs in zip(ours, ref):
        assert mine.dtype == theirs.dtype
        if autocast:  # bf16 products: one rounding of the sum here, three there
            assert (mine - theirs).norm() <= 1e-2 * theirs.norm()
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(add_low_rank(F.linear(x, w), x, a, b, 2.0), _plain(F.linear(x, w), x, a, b, 2.0))


def test_low_rank_update_keeps_no_output_sized_tensor_for_backward():
    x = torch.randn(3, 16, requires_grad=True)
    w, a, b = torch.randn(40, 16), torch.randn(4, 16, requires_grad=True), torch.randn(40, 4, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = add_low_rank(F.linear(x, w), x, a, b, 0.5)
    assert out.grad_fn.name() == AddLowRank.__name__ + "Backward"
    # besides the weights: the input and u = x A^T, nothing of the output's size [3, 40]
    weights = {t.data_ptr() for t in (w, a, b)}
    assert sorted(tuple(t.shape) for t in saved if t.data_ptr() not in weights) == [(3, 4), (3, 16)]


def test_the_output_projection_sees_only_positions_that_take_a_loss():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 6, 8, generator=g, requires_grad=True)
    output = nn.Linear(8, 11, bias=False)
    target = torch.randint(0, 11, (2, 6), generator=g)
    target[0, :4] = target[1, 2:] = -100
    rows = []
    output.register_forward_hook(lambda m, args, out: rows.append(args[0].numel() // args[0].shape[-1]))
    loss = OutputLoss(fused=False)(h, output, target)
    (grad,) = torch.autograd.grad(loss, h)
    assert rows == [4]  # of 12 positions, the 4 trained
    ref = cross_entropy(output(h), target)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, h)[0])
    assert OutputLoss(fused=False)(h, output, torch.full((2, 6), -100)).item() == 0.0  # nothing trained: 0
