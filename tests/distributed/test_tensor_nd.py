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
