"""The kernels as PyTorch custom operators (:mod:`trickles.kernels`): every registration passes
``torch.library.opcheck`` (schema, fake implementation, autograd registration, AOTAutograd with dynamic shapes) in
fp32, bf16 and fp16, and blocks compiled with ``fullgraph=True`` keep the kernels inside as opaque nodes and give the
eager losses and gradients. The vocabulary-parallel losses are operators too, checked here on a 1-rank gloo group (on
two ranks: ``tests/distributed/test_tensor_parallel.py``).

Without a GPU the Triton kernels run in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``);
Dynamo never traces into it, since it sees only the operators.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

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


LOW = (torch.bfloat16, torch.float16)
LOOSE = {"rtol": 2.0**-7, "atol": 2.0**-7}  # a low-precision loss against the fp32 one from the same inputs


def _cases(dtype=torch.float32):
    """(op, args) for every operator with inputs of ``dtype``, forward ops with inputs that require gradients (the
    autograd registration is checked), backward ops with plain ones. In bf16 and fp16 also the mixed types a model
    hands them (fp32 norm weights, an fp32 gate, an fp32 output weight), where the fakes' type rules (promotion, the
    fp32 statistics, the fused loss's fp32 ``dh`` under fp16) decide the outputs' types."""
    t = lambda *s, seed=0, dt=dtype: _t(*s, seed=seed, dtype=dt)  # noqa: E731
    plain = lambda *s, seed=0, dt=dtype: _t(*s, grad=False, seed=seed, dtype=dt)  # noqa: E731
    x, w, b = t(3, 5, 24), t(24, seed=1), t(24, seed=2)
    rows = 15
    cos, sin = (c.to(DEVICE) for c in rope_tables(8, 5, 10000.0))
    q, k = t(2, 5, 3, 8, seed=3), t(2, 5, 1, 8, seed=4)
    a, bb = t(4, 37, seed=5), t(4, 37, seed=6)
    h, wv = t(11, 16, seed=7), t(50, 16, seed=8)
    target = torch.randint(0, 50, (11,), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    target[2] = IGNORE_INDEX
    rstd = plain(rows, dt=torch.float32).abs() + 0.5
    cases = [
        (rms_norm_op, (x, w, 1e-5)),
        (rms_norm_backward_op, (plain(3, 5, 24), x.detach(), w.detach(), rstd)),
        (layer_norm_op, (x, w, b, 1e-5)),
        (
            layer_norm_backward_op,
            (plain(3, 5, 24), x.detach(), w.detach(), b.detach(), plain(rows, dt=torch.float32), rstd),
        ),
        (rotary_op, (q, k, cos, sin)),
        (rotary_backward_op, (plain(2, 5, 3, 8), plain(2, 5, 1, 8), cos, sin)),
        (swiglu_op, (a, bb)),
        (swiglu_backward_op, (plain(4, 37), a.detach(), bb.detach())),
        (swiglu_packed_op, (t(4, 38, seed=10),)),
        (swiglu_packed_backward_op, (plain(4, 19), plain(4, 38, seed=1))),
        (gelu_tanh_op, (a,)),
        (gelu_tanh_backward_op, (plain(4, 37), a.detach())),
        (linear_cross_entropy_op, (h, wv, None, target, 4, dtype, True, True, True, False)),
        (linear_cross_entropy_op, (h, wv, t(50, seed=11), target, 4, dtype, False, True, True, True)),
        (linear_cross_entropy_op, (h.detach(), wv.detach(), None, target, 4, dtype, True, False, False, False)),
    ]
    if dtype == torch.float32:
        return cases
    w32, b32, gate32 = (t(*s, seed=i, dt=torch.float32) for i, s in ((12, (24,)), (13, (24,)), (14, (4, 37))))
    return cases + [
        (rms_norm_op, (x, w32, 1e-5)),
        (rms_norm_backward_op, (plain(3, 5, 24, dt=torch.float32), x.detach(), w32.detach(), rstd)),
        (layer_norm_op, (x, w32, b32, 1e-5)),
        (swiglu_op, (a, gate32)),
        (swiglu_backward_op, (plain(4, 37, dt=torch.float32), a.detach(), gate32.detach())),
        (
            linear_cross_entropy_op,
            (h, t(50, 16, seed=15, dt=torch.float32), None, target, 4, dtype, True, True, True, False),
        ),
    ]


CASES = [(op, args) for dtype in (torch.float32, *LOW) for op, args in _cases(dtype)]
IDS = [f"{op._name.split('::')[-1]}-{i}-{str(args[0].dtype)[6:]}" for i, (op, args) in enumerate(CASES)]


@pytest.mark.parametrize("op,args", CASES, ids=IDS)
def test_opcheck(op, args):
    """Every operator's registration, in fp32, bf16 and fp16 (and the mixed types of a model under mixed precision):
    the fake implementation must give the real outputs' shapes and types in each."""
    torch.library.opcheck(op, args)


@pytest.fixture
def one_rank_tp(tmp_path):
    """A 1-rank gloo process group in this process, as the tensor-parallel communicator ``tp``."""
    import torch.distributed as dist

    from trickles.comm import CommLedger, GroupComm

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield GroupComm("tp", dist.group.WORLD, CommLedger())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_the_vocabulary_parallel_losses_are_operators(one_rank_tp, dtype):
    """The tensor-parallel losses are operators taking their group by name (``ProcessGroup.group_name``): opcheck passes
    for ``trickles::vocab_parallel_cross_entropy`` (fp32 losses and softmax from logits of any type) and for the fused
    ``trickles::linear_cross_entropy`` with a group; their losses and gradients equal ``F.cross_entropy``'s."""
    from trickles.kernels.groups import comm_name
    from trickles.parallel.tensor.loss import vocab_parallel_ce_op, vocab_parallel_losses

    logits, target = _t(6, 10, seed=20, dtype=dtype), torch.tensor([0, 9, IGNORE_INDEX, 3, 3, 7], device=DEVICE)
    name = comm_name(one_rank_tp)
    assert name == one_rank_tp.group.group_name
    torch.library.opcheck(vocab_parallel_ce_op, (logits, target, name, 0))
    losses = vocab_parallel_losses(logits, target, one_rank_tp, 0)
    ref = F.cross_entropy(logits.float(), target, reduction="none")
    torch.testing.assert_close(losses, ref)
    (g,) = torch.autograd.grad(losses.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    assert g.dtype == dtype
    torch.testing.assert_close(g, g_ref)
    h, w = _t(6, 8, seed=21, dtype=dtype), _t(10, 8, seed=22, dtype=dtype)
    fused = (h, w, None, target, 4, dtype, False, True, True, False, name, 0)
    torch.library.opcheck(linear_cross_entropy_op, fused)
    unfused = F.cross_entropy(F.linear(h, w).float(), target)
    torch.testing.assert_close(linear_cross_entropy_op(*fused)[0], unfused, **({} if dtype == torch.float32 else LOOSE))
    with pytest.raises(RuntimeError, match="no communicator is registered for process group 'nowhere'"):
        vocab_parallel_ce_op(logits, target, "nowhere", 0)


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
