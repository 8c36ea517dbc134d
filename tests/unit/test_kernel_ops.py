"""The kernels as PyTorch custom operators (:mod:`trickles.kernels`): every registration passes ``torch.library.opcheck``
(schema, fake implementation, autograd registration, AOTAutograd with dynamic shapes), and blocks compiled with
``fullgraph=True`` keep the kernels inside as opaque nodes and give the eager losses and gradients.

Without a GPU the Triton kernels run in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``);
Dynamo never traces into it, since it sees only the operators.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from trickles.kernels import interpreting  # noqa: E402
from trickles.kernels.activations import (
    gelu_tanh_backward_op,
    gelu_tanh_op,
    swiglu_backward_op,
    swiglu_op,  # noqa: E402
    swiglu_packed_backward_op,
    swiglu_packed_op,
)
from trickles.kernels.cross_entropy import IGNORE_INDEX, linear_cross_entropy_op  # noqa: E402
from trickles.kernels.norms import layer_norm_backward_op, layer_norm_op, rms_norm_backward_op, rms_norm_op  # noqa: E402
from trickles.kernels.rotary import rotary_backward_op, rotary_op  # noqa: E402
from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.transformer import build_model, rope_tables  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True, scope="module")
def _kernels_run_here():
    assert DEVICE.type == "cuda" or interpreting(), "no GPU and no TRITON_INTERPRET=1: the Triton kernels cannot run"


def _t(*shape, grad=True, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_(grad)


def _cases():
    """(op, args) for every operator, forward ops with inputs that require gradients (the autograd registration is
    checked), backward ops with plain ones."""
    x, w, b = _t(3, 5, 24), _t(24, seed=1), _t(24, seed=2)
    rows = 15
    cos, sin = (t.to(DEVICE) for t in rope_tables(8, 5, 10000.0))
    q, k = _t(2, 5, 3, 8, seed=3), _t(2, 5, 1, 8, seed=4)
    a, bb = _t(4, 37, seed=5), _t(4, 37, seed=6)
    h, wv = _t(11, 16, seed=7), _t(50, 16, seed=8)
    target = torch.randint(0, 50, (11,), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    target[2] = IGNORE_INDEX
    plain = lambda *s, seed=0: _t(*s, grad=False, seed=seed)  # noqa: E731
    rstd = plain(rows).abs() + 0.5
    return [
        (rms_norm_op, (x, w, 1e-5)),
        (rms_norm_backward_op, (plain(3, 5, 24), x.detach(), w.detach(), rstd)),
        (layer_norm_op, (x, w, b, 1e-5)),
        (layer_norm_backward_op, (plain(3, 5, 24), x.detach(), w.detach(), b.detach(), plain(rows), rstd)),
        (rotary_op, (q, k, cos, sin)),
        (rotary_backward_op, (plain(2, 5, 3, 8), plain(2, 5, 1, 8), cos, sin)),
        (swiglu_op, (a, bb)),
        (swiglu_backward_op, (plain(4, 37), a.detach(), bb.detach())),
        (swiglu_packed_op, (_t(4, 38, seed=10),)),
        (swiglu_packed_backward_op, (plain(4, 19), plain(4, 38, seed=1))),
        (gelu_tanh_op, (a,)),
        (gelu_tanh_backward_op, (plain(4, 37), a.detach())),
        (linear_cross_entropy_op, (h, wv, None, target, 4, torch.float32, True, True, True, False)),
        (linear_cross_entropy_op, (h, wv, _t(50, seed=11), target, 4, torch.float32, False, True, True, True)),
    ]


CASES = _cases()


@pytest.mark.parametrize("op,args", CASES, ids=[f"{op._name.split('::')[-1]}-{i}" for i, (op, _) in enumerate(CASES)])
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


def _model_pair(flavor: str):
    cfg = ModelConfig(
        flavor=flavor,
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2 if flavor == "llama" else None,
        ffn_hidden=48,
        vocab_size=97,
        max_seq_len=8,
        kernels="triton",
        loss_chunk=5,
    )
    return build_model(cfg, 0, DEVICE), build_model(dataclasses.replace(cfg), 0, DEVICE)


@pytest.mark.parametrize("flavor", ["llama", "gpt2"])
def test_blocks_compiled_with_the_kernels_give_the_eager_loss_and_gradients(flavor):
    """Every block compiled with ``fullgraph=True`` (a graph break would fail) holds the kernels as custom operators
    (none traced into Triton: the graph is whole), and the loss and every gradient equal the eager model's to 1e-5."""
    torch._dynamo.reset()
    eager, compiled = _model_pair(flavor)
    for block in compiled.layers.values():
        block.compile(fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 97, (2, 8), generator=g).to(DEVICE) for _ in range(2))
    y[1, :2] = IGNORE_INDEX
    ref, loss = eager(x, target=y), compiled(x, target=y)
    ref.backward()
    loss.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-5 * abs(float(ref.detach()))
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(
            q.grad, p.grad, rtol=1e-5, atol=1e-5 * max(float(p.grad.abs().max()), 1e-4), msg=name
        )


def test_the_fused_loss_compiles_whole_with_inductor():
    """The head (final norm, fused output projection + cross-entropy) compiled by Inductor with ``fullgraph=True``:
    the loss operator stays one node; loss and gradients equal the eager head's to 1e-5."""
    torch._dynamo.reset()
    eager, compiled = _model_pair("llama")
    head = torch.compile(compiled.head, fullgraph=True)
    h = _t(2, 8, 32, seed=12)
    y = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref = eager.head(h, y)
    dh_ref, dw_ref = torch.autograd.grad(ref, [h, eager.output.weight])
    loss = head(h, y)
    dh, dw = torch.autograd.grad(loss, [h, compiled.output.weight])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-7)
