"""Multi-dimensional tensor parallelism (:mod:`trickles.parallel.tensor_nd`): each layer against the dense one.

2-D on a 2 x 2 grid (tp = 4): forward and backward of :class:`Linear2D` equal ``F.linear`` on the whole tensors to
1e-6 relative (fp32), on widths that are not powers of two, and every rank sends exactly the bytes its docstring's
formula gives (the ledger). A ``tp`` the mode cannot arrange is refused before any process group exists, naming
the nearest valid values.
"""

import pytest
import torch
import torch.nn.functional as F

from trickles.errors import ConfigError
from trickles.parallel.tensor_nd import Linear2D, split_2d
from trickles.testing import run_ranks
from trickles.topology import ParallelDims

CPU = torch.device("cpu")


def _linear_2d(n_tokens, h, h2, bias):
    topo = ParallelDims(tp=4, tp_mode="2d").build(CPU)
    row, col = topo.comm("tp_row"), topo.comm("tp_col")
    i, j, _ = topo.dims.grid.coords(topo.rank % 4)
    assert (col.rank, row.rank) == (i, j)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(n_tokens, h, generator=g), torch.randn(h2, h, generator=g), torch.randn(h2, generator=g)
    dy = torch.randn(n_tokens, h2, generator=g)
    layer = Linear2D(h, h2, bias, row, col)
    with torch.no_grad():
        layer.weight.copy_(split_2d(w, j, i, 2))  # weight = A^T: block (j, i)
        if bias:
            layer.bias.copy_(b.chunk(2)[j])
    assert layer.weight.tp_spec.offset == (j * h2 // 2, i * h // 2)
    xs = split_2d(x, i, j, 2).clone().requires_grad_()
    topo.ledger.reset()
    y = layer(xs)
    forward_bytes = topo.ledger.bytes(wire=True)
    y.backward(split_2d(dy, i, j, 2))
    backward_bytes = topo.ledger.bytes(wire=True) - forward_bytes
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref_b = b.clone().requires_grad_() if bias else None
    ref = F.linear(ref_x, ref_w, ref_b)
    ref.backward(dy)
    out = {"y": (y.detach(), split_2d(ref.detach(), i, j, 2)), "dx": (xs.grad, split_2d(ref_x.grad, i, j, 2)),
           "dw": (layer.weight.grad, split_2d(ref_w.grad, j, i, 2))}
    if bias:
        out["db"] = (layer.bias.grad, ref_b.grad.chunk(2)[j])
    return out, (forward_bytes, backward_bytes), layer.wire_bytes(n_tokens // 2, 4)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_2d_equals_the_dense_layer_and_sends_the_formula_bytes(bias):
    """12 tokens, 20 -> 36 features: forward, input, weight (and bias) gradients of every block within 1e-6 relative
    of the dense layer's; the ledger's bytes per rank are the docstring's, forward and backward."""
    for out, measured, formula in run_ranks(4, _linear_2d, 12, 20, 36, bias):
        for name, (got, want) in out.items():
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()), msg=name)
        assert measured == (formula["forward"], formula["backward"]), (measured, formula)


@pytest.mark.parametrize("mode,tp,depth,nearest", [("2d", 6, 1, "4 or 9"), ("2.5d", 12, 2, "8 or 18"), ("3d", 9, 1, "8 or 27"),
                                                 ("2d", 1, 1, "4 or 9")])
def test_a_tp_the_grid_cannot_hold_is_refused_with_the_nearest_values(mode, tp, depth, nearest):
    with pytest.raises(ConfigError, match=f"use parallel.tp={nearest}$"):
        ParallelDims.infer(tp * 2, tp=tp, tp_mode=mode, tp_depth=depth)


def _blocks(t: torch.Tensor, dim: int, parts: list[tuple[int, int]]) -> torch.Tensor:
    """Nested block ``(index, count)`` after ``(index, count)`` of ``t`` along ``dim``."""
    for index, count in parts:
        t = t.chunk(count, dim=dim)[index]
    return t


def _linear_2p5d(n_tokens, h, h2):
    """2.5-D at q = 2, d = 2: layer k of the stack runs its 2-D block on token block k."""
    from trickles.parallel.tensor_nd import Linear2p5D

    topo = ParallelDims(tp=8, tp_mode="2.5d", tp_depth=2).build(CPU)
    row, col, dep = topo.comm("tp_row"), topo.comm("tp_col"), topo.comm("tp_dep")
    i, j, k = topo.dims.grid.coords(topo.rank % 8)
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(n_tokens, h, generator=g), torch.randn(h2, h, generator=g), torch.randn(h2, generator=g)
    dy = torch.randn(n_tokens, h2, generator=g)
    layer = Linear2p5D(h, h2, True, row, col, dep)
    with torch.no_grad():
        layer.weight.copy_(split_2d(w, j, i, 2))
        layer.bias.copy_(b.chunk(2)[j])
    rows = [(k, 2), (i, 2)]  # token block k of the stack, then row i's half of it
    xs = _blocks(x, 0, rows).chunk(2, dim=1)[j].clone().requires_grad_()
    topo.ledger.reset()
    y = layer(xs)
    y.backward(_blocks(dy, 0, rows).chunk(2, dim=1)[j])
    sent = topo.ledger.bytes(wire=True)
    rx, rw, rb = (t.clone().requires_grad_() for t in (x, w, b))
    F.linear(rx, rw, rb).backward(dy)
    ref_y = F.linear(x, w, b)
    out = {"y": (y.detach(), _blocks(ref_y, 0, rows).chunk(2, dim=1)[j]),
           "dx": (xs.grad, _blocks(rx.grad, 0, rows).chunk(2, dim=1)[j]),
           "dw": (layer.weight.grad, split_2d(rw.grad, j, i, 2)), "db": (layer.bias.grad, rb.grad.chunk(2)[j])}
    formula = layer.wire_bytes(n_tokens // 4, 4)
    return out, sent, formula["forward"] + formula["backward"]


def test_linear_2p5d_equals_the_dense_layer_and_sends_the_formula_bytes():
    """2.5-D, q = 2, d = 2 (tp = 8), 16 tokens, 20 -> 36 features with a bias: every block within 1e-6 relative of the
    dense layer's, the weight and bias gradients summed over the depth; the ledger's bytes are the docstring's."""
    for out, sent, formula in run_ranks(8, _linear_2p5d, 16, 20, 36):
        for name, (got, want) in out.items():
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()), msg=name)
        assert sent == formula, (sent, formula)


def _linear_3d_chain(n_tokens, h, h2, h3):
    """Two 3-D layers, the second in the swapped orientation, against two dense ones."""
    from trickles.parallel.tensor_nd import Linear3D

    topo = ParallelDims(tp=8, tp_mode="3d").build(CPU)
    row, col, dep = topo.comm("tp_row"), topo.comm("tp_col"), topo.comm("tp_dep")
    i, j, k = topo.dims.grid.coords(topo.rank % 8)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n_tokens, h, generator=g)
    w1, b1 = torch.randn(h2, h, generator=g), torch.randn(h2, generator=g)
    w2, b2 = torch.randn(h3, h2, generator=g), torch.randn(h3, generator=g)
    dy = torch.randn(n_tokens, h3, generator=g)
    first = Linear3D(h, h2, True, row, col, dep, orientation=0)  # a = rows (u = j), b = depth (v = k), c: w = i
    second = Linear3D(h2, h3, True, row, col, dep, orientation=1)  # a = depth (u = k), b = rows (v = j)
    with torch.no_grad():
        for layer, w, b, (u, v) in ((first, w1, b1, (j, k)), (second, w2, b2, (k, j))):
            layer.weight.copy_(_blocks(w.chunk(2, dim=0)[u], 1, [(v, 2), (i, 2)]))
            layer.bias.copy_(b.chunk(2)[u])
            assert layer.weight.tp_spec.offset == (u * w.shape[0] // 2, v * w.shape[1] // 2 + i * w.shape[1] // 4)
    xs = _blocks(x, 0, [(i, 2), (j, 2)]).chunk(2, dim=1)[k].clone().requires_grad_()
    topo.ledger.reset()
    y = second(first(xs))
    out_rows = [(i, 2), (j, 2)]  # the second layer's output: token block i, sub-block v = j, features u = k
    y.backward(_blocks(dy, 0, out_rows).chunk(2, dim=1)[k])
    sent = topo.ledger.bytes(wire=True)
    rx, rw1, rb1, rw2, rb2 = (t.clone().requires_grad_() for t in (x, w1, b1, w2, b2))
    ref = F.linear(F.linear(rx, rw1, rb1), rw2, rb2)
    ref.backward(dy)
    out = {"y": (y.detach(), _blocks(ref.detach(), 0, out_rows).chunk(2, dim=1)[k]),
           "dx": (xs.grad, _blocks(rx.grad, 0, [(i, 2), (j, 2)]).chunk(2, dim=1)[k]),
           "dw1": (first.weight.grad, _blocks(rw1.grad.chunk(2, dim=0)[j], 1, [(k, 2), (i, 2)])),
           "dw2": (second.weight.grad, _blocks(rw2.grad.chunk(2, dim=0)[k], 1, [(j, 2), (i, 2)])),
           "db1": (first.bias.grad, rb1.grad.chunk(2)[j]), "db2": (second.bias.grad, rb2.grad.chunk(2)[k])}
    formula = sum(sum(layer.wire_bytes(n_tokens, 4).values()) for layer in (first, second))
    return out, sent, formula


def test_linear_3d_layers_chain_and_equal_the_dense_layers():
    """3-D, q = 2 (tp = 8): two layers (12 -> 20 -> 6 features, biases), the second taking the first's output layout as
    it comes (orientation swapped), against two dense layers: output, input and every weight and bias gradient within
    1e-6 relative; the ledger's bytes are the docstring's."""
    for out, sent, formula in run_ranks(8, _linear_3d_chain, 8, 12, 20, 6):
        for name, (got, want) in out.items():
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()), msg=name)
        assert sent == formula, (sent, formula)
