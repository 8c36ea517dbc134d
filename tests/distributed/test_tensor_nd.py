"""Multi-dimensional tensor parallelism (:mod:`trickles.parallel.tensor.grid_linear`): each layer against the dense one.

2-D on a 2 x 2 grid (tp = 4), 2.5-D on two of them (tp = 8) and 3-D on a 2 x 2 x 2 cube (tp = 8): forward and
backward of :class:`Linear2D`, :class:`Linear2p5D` and chained :class:`Linear3D` layers equal ``F.linear`` on the
whole tensors to 1e-6 relative (fp32), on widths that are not powers of two, and every rank sends exactly the bytes
its docstring's formula gives (the ledger). A ``tp`` the mode cannot arrange is refused before any process group
exists, naming the nearest valid values.

The rest of the model (:mod:`trickles.parallel.tensor.grid_model`), each rank's block against the dense layer to 1e-6
relative, forward and every gradient: :class:`GridNorm` (RMSNorm and LayerNorm) in every mode,
:class:`GridEmbedding` (2-D untied and tied -- the transposed block exchange --, 2.5-D, 3-D), :class:`GridPositions`
(2-D, 3-D), :class:`GridLoss` with the output layer and ignored targets in every mode. Vocabulary 38 and width 20
(3-D: 5 features per block) divide by the grid but are not powers of two; a width, vocabulary or micro-batch that
does not divide is a ValueError naming the multiple.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from trickles.errors import ConfigError
from trickles.parallel.tensor.grid_linear import Linear2D, split_2d
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
    out = {
        "y": (y.detach(), split_2d(ref.detach(), i, j, 2)),
        "dx": (xs.grad, split_2d(ref_x.grad, i, j, 2)),
        "dw": (layer.weight.grad, split_2d(ref_w.grad, j, i, 2)),
    }
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


@pytest.mark.parametrize(
    "mode,tp,depth,nearest",
    [("2d", 6, 1, "4 or 9"), ("2.5d", 12, 2, "8 or 18"), ("3d", 9, 1, "8 or 27"), ("2d", 1, 1, "4 or 9")],
)
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
    from trickles.parallel.tensor.grid_linear import Linear2p5D

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
    out = {
        "y": (y.detach(), _blocks(ref_y, 0, rows).chunk(2, dim=1)[j]),
        "dx": (xs.grad, _blocks(rx.grad, 0, rows).chunk(2, dim=1)[j]),
        "dw": (layer.weight.grad, split_2d(rw.grad, j, i, 2)),
        "db": (layer.bias.grad, rb.grad.chunk(2)[j]),
    }
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
    from trickles.parallel.tensor.grid_linear import Linear3D

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
    out = {
        "y": (y.detach(), _blocks(ref.detach(), 0, out_rows).chunk(2, dim=1)[k]),
        "dx": (xs.grad, _blocks(rx.grad, 0, [(i, 2), (j, 2)]).chunk(2, dim=1)[k]),
        "dw1": (first.weight.grad, _blocks(rw1.grad.chunk(2, dim=0)[j], 1, [(k, 2), (i, 2)])),
        "dw2": (second.weight.grad, _blocks(rw2.grad.chunk(2, dim=0)[k], 1, [(j, 2), (i, 2)])),
        "db1": (first.bias.grad, rb1.grad.chunk(2)[j]),
        "db2": (second.bias.grad, rb2.grad.chunk(2)[k]),
    }
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


# ---- the rest of the model's layers: norms, embeddings, positions, loss ---------------------------------------

GRIDS = {
    "2d": (4, {"tp": 4, "tp_mode": "2d"}),
    "2.5d": (8, {"tp": 8, "tp_mode": "2.5d", "tp_depth": 2}),
    "3d": (8, {"tp": 8, "tp_mode": "3d"}),
}


def _grid(mode):
    from trickles.parallel.tensor.grid_plan import grid_context

    topo = ParallelDims(**GRIDS[mode][1]).build(CPU)
    return grid_context(topo), topo


def _mine(ctx, full):
    """This rank's block of a whole micro-batch's residual stream ``[B, T, d]``: its samples, its features."""
    return full.chunk(ctx.parts)[ctx.block].chunk(ctx.q, dim=-1)[ctx.hidden.rank]


def _spec_block(full, p):
    """The block of ``full`` the parameter ``p`` holds, by its spec (global shape and offset)."""
    assert tuple(full.shape) == p.tp_spec.global_shape, (full.shape, p.tp_spec)
    return full[p.tp_spec.block(p.shape)]


def _assert_all_close(results):
    for out in results:
        for name, (got, want) in out.items():
            assert got.shape == want.shape, (name, got.shape, want.shape)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()), msg=name)


def _norms(mode, B, T, d):
    from trickles.parallel.tensor.grid_model import GridNorm

    ctx, _ = _grid(mode)
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(B, T, d, generator=g) * 2 + 0.5, torch.randn(B, T, d, generator=g)
    w, b = 1 + 0.1 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    out = {}
    for layer_norm in (False, True):
        kind = "layer" if layer_norm else "rms"
        norm = GridNorm(d, 1e-5, layer_norm, ctx)
        with torch.no_grad():
            norm.weight.copy_(_spec_block(w, norm.weight))
            if layer_norm:
                norm.bias.copy_(_spec_block(b, norm.bias))
        xs = _mine(ctx, x).clone().requires_grad_()
        y = norm(xs)
        y.backward(_mine(ctx, dy))
        rx, rw, rb = (t.clone().requires_grad_() for t in (x, w, b))
        ref = F.layer_norm(rx, (d,), rw, rb, 1e-5) if layer_norm else F.rms_norm(rx, (d,), rw, 1e-5)
        ref.backward(dy)
        out.update(
            {
                f"{kind} y": (y.detach(), _mine(ctx, ref.detach())),
                f"{kind} dx": (xs.grad, _mine(ctx, rx.grad)),
                f"{kind} dw": (norm.weight.grad, _spec_block(rw.grad, norm.weight)),
            }
        )
        if layer_norm:
            out[f"{kind} db"] = (norm.bias.grad, _spec_block(rb.grad, norm.bias))
    return out


@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_grid_norms_equal_the_dense_norms(mode):
    """RMSNorm and LayerNorm over features split on the hidden group, 8 samples of 3 tokens, width 20: output, input
    gradient and the weight's (and bias's) gradient -- summed over the ranks holding the block alike -- within 1e-6
    relative of ``F.rms_norm`` / ``F.layer_norm`` on the whole tensors."""
    _assert_all_close(run_ranks(GRIDS[mode][0], _norms, mode, 8, 3, 20))


def _embedding(mode, tied, B, T, V, d):
    from trickles.parallel.tensor.grid_model import GridEmbedding

    ctx, _ = _grid(mode)
    g = torch.Generator().manual_seed(4)
    table, dy = torch.randn(V, d, generator=g), torch.randn(B, T, d, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, :2], ids[-1, -2:] = torch.tensor([0, V - 1]), torch.tensor([V - 1, 0])  # both ends of the vocabulary
    emb = GridEmbedding(V, d, ctx, tied)
    with torch.no_grad():
        emb.weight.copy_(_spec_block(table, emb.weight))
    y = emb(ids)
    y.backward(_mine(ctx, dy))
    ref_table = table.clone().requires_grad_()
    ref = F.embedding(ids, ref_table)
    ref.backward(dy)
    return {
        "y": (y.detach(), _mine(ctx, ref.detach())),
        "d_table": (emb.weight.grad, _spec_block(ref_table.grad, emb.weight)),
    }


@pytest.mark.parametrize(
    "mode,tied", [("2d", False), ("2d", True), ("2.5d", False), ("3d", True)], ids=["2d", "2d-tied", "2.5d", "3d"]
)
def test_grid_embedding_equals_the_dense_embedding(mode, tied):
    """8 samples of 3 tokens, vocabulary 38, width 20 (3-D: 19 rows and 5 features per block): each rank's block of
    the looked-up residual stream and its block of the table's gradient (summed over the samples of every rank, and
    for 2.5-D over the depth) within 1e-6 relative of the dense embedding's. Tied: the block is laid out as the output
    layer's (transposed) and exchanged with the grid's mirror rank; 3-D is always laid out as the output layer."""
    _assert_all_close(run_ranks(GRIDS[mode][0], _embedding, mode, tied, 8, 3, 38, 20))


def _positions(mode, B, T, max_len, d):
    from trickles.parallel.tensor.grid_model import GridPositions

    ctx, _ = _grid(mode)
    g = torch.Generator().manual_seed(5)
    table, dy = torch.randn(max_len, d, generator=g), torch.randn(B, T, d, generator=g)
    positions = torch.arange(2, 2 + T)  # not from 0: a continued sequence
    pos = GridPositions(max_len, d, ctx)
    with torch.no_grad():
        pos.weight.copy_(_spec_block(table, pos.weight))
    y = pos(positions)
    (y.unsqueeze(0) * _mine(ctx, dy)).sum().backward()  # added to each of this rank's samples
    ref_table = table.clone().requires_grad_()
    ref = F.embedding(positions, ref_table)
    (ref.unsqueeze(0) * dy).sum().backward()
    return {
        "y": (y.detach(), ref.detach().chunk(ctx.q, dim=-1)[ctx.hidden.rank]),
        "d_table": (pos.weight.grad, _spec_block(ref_table.grad, pos.weight)),
    }


@pytest.mark.parametrize("mode", ["2d", "3d"])
def test_grid_positions_equal_the_dense_positions(mode):
    """Learned positions (gpt2), 10 rows of width 20, positions 2..6 added to 8 samples: this rank's features of the
    looked-up positions, and its block of the table's gradient summed over every rank's samples, within 1e-6
    relative of the dense table's."""
    _assert_all_close(run_ranks(GRIDS[mode][0], _positions, mode, 8, 5, 10, 20))


def _loss(mode, B, T, V, d):
    from trickles.parallel.tensor.grid_model import GridLoss

    ctx, _ = _grid(mode)
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(B, T, d, generator=g), torch.randn(V, d, generator=g) * 0.5
    target = torch.randint(0, V, (B, T), generator=g)
    target[0, :2], target[-1, -1] = torch.tensor([0, V - 1]), V - 1
    target[1] = -100  # a sample ignored whole: its rank's block counts fewer tokens
    target[2, ::2] = -100
    output = ctx.linear(d, V, False)
    with torch.no_grad():
        output.weight.copy_(_spec_block(w, output.weight))
    hs = _mine(ctx, h).clone().requires_grad_()
    loss = GridLoss(ctx)(hs, output, target)
    loss.backward()
    rh, rw = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(rh, rw).flatten(0, 1), target.flatten(), ignore_index=-100)
    ref.backward()
    return {
        "loss": (loss.detach(), ref.detach()),
        "dh": (hs.grad, _mine(ctx, rh.grad)),
        "dw": (output.weight.grad, _spec_block(rw.grad, output.weight)),
    }


@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_grid_loss_equals_the_dense_cross_entropy(mode):
    """The output layer (width 20 -> vocabulary 38) and the vocabulary-parallel cross-entropy, 8 samples of 6 tokens,
    one sample and half of another ignored (-100): every rank's loss is the micro-batch's mean over the tokens not
    ignored, and the hidden states' and output weight's gradients, within 1e-6 relative of ``F.cross_entropy``'s."""
    _assert_all_close(run_ranks(GRIDS[mode][0], _loss, mode, 8, 6, 38, 20))


def _refusals():
    from trickles.parallel.tensor.grid_model import GridEmbedding, GridNorm, GridPositions

    ctx2, _ = _grid("2d")
    messages = []
    for make in (
        lambda: GridNorm(21, 1e-5, False, ctx2),
        lambda: GridEmbedding(39, 20, ctx2, False),
        lambda: GridPositions(10, 21, ctx2),
        lambda: ctx2.rows(torch.zeros(3, 4)),
        lambda: GridPositions(10, 20, ctx2)(torch.zeros(2, 3, dtype=torch.long)),
    ):
        try:
            make()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def _refusals_3d():
    from trickles.parallel.tensor.grid_model import GridEmbedding

    ctx, _ = _grid("3d")
    messages = []
    for make in (lambda: GridEmbedding(38, 22, ctx, True), lambda: ctx.rows(torch.zeros(6, 4))):
        try:
            make()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_grid_layers_refuse_what_does_not_split_naming_the_multiple():
    """A width, vocabulary or micro-batch the grid cannot split is a ValueError naming the multiple to use (2-D, q = 2:
    widths and the vocabulary in 2 blocks, 2 sample blocks; 3-D: the embedding's width in q^2 = 4 blocks, 4 sample
    blocks); per-sample positions (left-padded decoding) are refused, naming 1-D tensor parallelism."""
    expected = [
        r"the model width \(21\) into 2 blocks; make it a multiple of 2$",
        r"the vocabulary \(39\) into 2 blocks; make it a multiple of 2$",
        r"the model width \(21\) into 2 blocks; make it a multiple of 2$",
        r"2d tensor parallelism splits each micro-batch's 3 samples into 2 blocks; "
        r"make the micro-batch a multiple of 2$",
        r"need 1-D tensor parallelism \(parallel.tp_mode=1d\)$",
    ]
    for messages in run_ranks(4, _refusals):
        assert len(messages) == len(expected)
        for got, want in zip(messages, expected):
            assert got is not None and re.search(want, got), (got, want)
    expected_3d = [
        r"the model width \(3-D: q\^2 blocks\) \(22\) into 4 blocks; make it a multiple of 4$",
        r"3d tensor parallelism splits each micro-batch's 6 samples into 4 blocks; "
        r"make the micro-batch a multiple of 4$",
    ]
    for messages in run_ranks(8, _refusals_3d):
        for got, want in zip(messages, expected_3d, strict=True):
            assert got is not None and re.search(want, got), (got, want)
