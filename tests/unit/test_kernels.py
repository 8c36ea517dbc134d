"""The fused kernels (:mod:`trickles.kernels`) against their PyTorch references, forward and backward.

On a machine without a GPU the Triton kernels run in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``); with one, compiled. fp32: equal to 1e-5 relative; bf16: within bf16 rounding of the
fp32 reference computed from the same bf16 inputs (two roundings, ``2^-7`` of the largest value). Shapes are
chosen against the kernels' blocking: hidden sizes that are not powers of two, a vocabulary that is not a
multiple of the cross-entropy's 4096-column block (the last block partial), chunks that do not divide the
tokens, and ignored targets (``-100``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from trickles.kernels import interpreting  # noqa: E402
from trickles.kernels.activations import gelu_tanh, swiglu, swiglu_packed  # noqa: E402
from trickles.kernels.cross_entropy import IGNORE_INDEX, default_chunk, linear_cross_entropy  # noqa: E402
from trickles.kernels.norms import layer_norm, rms_norm, rms_norm_reference  # noqa: E402
from trickles.kernels.rotary import apply_rope, rotary  # noqa: E402
from trickles.models.config import ModelConfig  # noqa: E402
from trickles.models.transformer import build_model, rope_tables  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16_TOL = 2.0**-7


@pytest.fixture(autouse=True, scope="module")
def _kernels_run_here():
    assert DEVICE.type == "cuda" or interpreting(), "no GPU and no TRITON_INTERPRET=1: the Triton kernels cannot run"


def _close(actual, expected, dtype):
    """fp32: 1e-5 relative (of each element and of the largest); bf16: two roundings of the largest value."""
    expected = expected.float()
    tol = 1e-5 if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol * float(expected.detach().abs().max()))


def _leaves(*shapes, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).to(DEVICE, dtype).requires_grad_() for s in shapes]


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, dy)


def _reference(fn, inputs):
    """``fn`` in fp32 on the same (possibly bf16) values: the output and the input gradients."""
    ref = [x.detach().float().requires_grad_() for x in inputs]
    out = fn(*ref)
    return out, _grads(out, ref)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm(dtype):
    x, w = _leaves((3, 5, 100), (100,), dtype=dtype)
    with torch.no_grad():
        w.mul_(0.5).add_(1.0)
    out = rms_norm(x, w, 1e-5, "triton")
    assert out.dtype == dtype and out.shape == x.shape
    ref, ref_grads = _reference(lambda a, b: rms_norm_reference(a, b, 1e-5), [x, w])
    _close(out, ref, dtype)
    for g, r in zip(_grads(out, [x, w]), ref_grads):
        _close(g, r, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_layer_norm(dtype):
    x, w, b = _leaves((4, 3, 72), (72,), (72,), dtype=dtype)
    out = layer_norm(x, w, b, 1e-5, "triton")
    ref, ref_grads = _reference(lambda a, ww, bb: F.layer_norm(a, (72,), ww, bb, 1e-5), [x, w, b])
    _close(out, ref, dtype)
    for g, r in zip(_grads(out, [x, w, b]), ref_grads):
        _close(g, r, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rotary_rotates_queries_and_keys_into_new_tensors(dtype):
    """Head size 10 (halves of 5), three query heads and one key head in one launch; the queries are a strided view
    (heads of a wider projection output, as the unfused split is) and are left as they were."""
    q0, k0 = _leaves((2, 6, 4, 10), (2, 6, 1, 10), dtype=dtype)
    cos, sin = (t.to(DEVICE) for t in rope_tables(10, 6, 10000.0))
    q, k = (q0 * 1)[:, :, 1:], k0 * 1  # non-leaf tensors, as the projections' outputs are
    before = q.detach().clone()
    rq, rk = rotary(q, k, cos, sin, "triton")
    assert rq.data_ptr() != q.data_ptr() and torch.equal(q.detach(), before) and rq.is_contiguous()
    out = torch.cat([rq.flatten(), rk.flatten()])
    ref, ref_grads = _reference(
        lambda a, b: torch.cat([apply_rope(a[:, :, 1:], cos, sin).flatten(), apply_rope(b, cos, sin).flatten()]),
        [q0, k0],
    )
    _close(out, ref, dtype)
    for g, r in zip(_grads(out, [q0, k0]), ref_grads):
        _close(g, r, dtype)


def test_rotary_with_per_row_tables():
    """Left-padded decoding hands each row its own positions: tables ``[B, T, D]`` read with their batch stride."""
    (q, k) = _leaves((2, 5, 2, 8), (2, 5, 2, 8), dtype=torch.float32)
    cos, sin = (t.to(DEVICE) for t in rope_tables(8, 9, 10000.0))
    positions = torch.tensor([[0, 1, 2, 3, 4], [4, 5, 6, 7, 8]], device=DEVICE)
    rq, rk = rotary(q, k, cos[positions], sin[positions], "triton")
    _close(rq, apply_rope(q, cos[positions], sin[positions]), torch.float32)
    _close(rk, apply_rope(k, cos[positions], sin[positions]), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_swiglu(dtype):
    a, b = _leaves((3, 7, 1100), (3, 7, 1100), dtype=dtype)  # more elements than one 1024-wide block, the last partial
    out = swiglu(a, b, "triton")
    ref, ref_grads = _reference(lambda x, y: F.silu(x) * y, [a, b])
    _close(out, ref, dtype)
    for g, r in zip(_grads(out, [a, b]), ref_grads):
        _close(g, r, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_swiglu_of_a_fused_gate_up_output(dtype):
    """The packed kernel reads ``a, b`` as neighbours of ``[..., f, 2]`` (f = 550: 1,650 pairs per row block, the last
    block partial) and writes their gradients as neighbours; the PyTorch path takes the same pairs apart."""
    (ab,) = _leaves((3, 1, 1100), dtype=dtype)
    out = swiglu_packed(ab, "triton")
    ref, (ref_grad,) = _reference(lambda x: F.silu(x[..., 0::2]) * x[..., 1::2], [ab])
    _close(out, ref, dtype)
    _close(_grads(out, [ab])[0], ref_grad, dtype)
    plain = swiglu_packed(ab, "torch")
    _close(plain, ref, dtype)
    _close(_grads(plain, [ab])[0], ref_grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gelu_tanh(dtype):
    (a,) = _leaves((5, 411), dtype=dtype, scale=2.0)
    out = gelu_tanh(a, "triton")
    ref, ref_grads = _reference(lambda x: F.gelu(x, approximate="tanh"), [a])
    _close(out, ref, dtype)
    _close(_grads(out, [a])[0], ref_grads[0], dtype)


def _ce_inputs(dtype, n=37, d=24, vocab=5003, bias=False):
    h, w, b = _leaves((n, d), (vocab, d), (vocab,), dtype=dtype)
    target = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    target[[i for i in (0, 5, 6, 30) if i < n]] = IGNORE_INDEX
    return h, w, (b if bias else None), target


def _ce_reference(h, w, b, target):
    """The unfused loss in fp32 on the same values, the logits rounded to the inputs' type as a matmul in that type
    returns them; its gradients for ``h``, ``w`` (and ``b``)."""
    leaves = [t.detach().float().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
    logits = F.linear(leaves[0], leaves[1], leaves[2] if b is not None else None).to(h.dtype).float()
    loss = F.cross_entropy(logits, target)
    return loss, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "kernels,dtype,bias",
    [
        ("torch", torch.float32, False),
        ("triton", torch.float32, True),
        ("torch", torch.bfloat16, False),
        ("triton", torch.bfloat16, False),
    ],
    ids=["torch-fp32", "triton-fp32-bias", "torch-bf16", "triton-bf16"],
)
def test_fused_linear_cross_entropy(kernels, dtype, bias):
    """37 tokens in chunks of 10 (the last one 7), four of them ignored; 5003 classes: two 4096-column blocks."""
    h, w, b, target = _ce_inputs(dtype, bias=bias)
    loss = linear_cross_entropy(h, w, target, b, chunk=10, kernels=kernels)
    ref, ref_grads = _ce_reference(h, w, b, target)
    _close(loss, ref, dtype)
    grads = torch.autograd.grad(loss * 3.0, [h, w] + ([b] if b is not None else []))  # the incoming gradient scales all
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if i == 1 and kernels == "triton" and dtype == torch.bfloat16:
            # the weight gradient sums bf16 products of bf16 logit gradients, one per chunk: within bf16 rounding of
            # the terms it adds up, sum_i |dz_i| |h_i|
            err, bound = (g.float() - 3.0 * r).abs(), 3.0 * BF16_TOL * (_abs_terms(h, w, target) + r.abs())
            assert (err <= bound).all(), float((err / bound).max())
        else:
            _close(g, 3.0 * r, dtype)


def _abs_terms(h, w, target):
    """``|dz|^T |h|``: the magnitudes of the terms the weight gradient sums, in fp32."""
    hf, wf = h.detach().float(), w.detach().float()
    dz = torch.softmax(hf @ wf.t(), dim=1) - F.one_hot(target.clamp(min=0), wf.shape[0]).float()
    dz = dz * (target != IGNORE_INDEX).float()[:, None] / float((target != IGNORE_INDEX).sum())
    return dz.abs().t() @ hf.abs()


def test_fused_cross_entropy_without_gradients_and_with_one_chunk():
    """Under no_grad it only measures the loss; the default chunk (liger-kernel's rule, at least 64 tokens) may
    cover every token."""
    h, w, _, target = _ce_inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, target, kernels="triton")
    assert loss.grad_fn is None
    _close(loss, _ce_reference(h, w, None, target)[0], torch.float32)
    assert (
        default_chunk(37, 5003, 24) == 37
        and default_chunk(4096, 32000, 4096) == 512
        and default_chunk(10, 10, 64) == 10
    )
    assert default_chunk(8192, 128256, 2048) == 256 and default_chunk(2048, 32000, 256) == 64  # (liger: 16)


def test_every_target_ignored_gives_zero_loss_and_gradients():
    h, w, _, target = _ce_inputs(torch.float32, n=6)
    target.fill_(IGNORE_INDEX)
    for kernels in ("torch", "triton"):
        loss = linear_cross_entropy(h, w, target, chunk=4, kernels=kernels)
        dh, dw = torch.autograd.grad(loss, [h, w])
        assert float(loss.detach()) == 0.0 and not dh.any() and not dw.any()


@pytest.mark.parametrize(
    "flavor,experts", [("llama", 0), ("gpt2", 0), ("llama", 4)], ids=["llama", "gpt2", "llama-moe"]
)
def test_model_with_triton_kernels_equals_the_eager_model(flavor, experts):
    """A whole model (norms, rotary, MLP activation -- the experts' too --, fused loss, and -- the default with
    ``kernels=triton`` -- fused q/k/v and gate/up projections, the rotary kernel rotating the split heads, the packed
    SwiGLU) against the eager unfused one: loss and every gradient, the fused ones cut into their parts."""
    from trickles.models.fused import split_state

    cfg = ModelConfig(
        flavor=flavor,
        n_layers=2,
        d_model=48,
        n_heads=4,
        n_kv_heads=2 if flavor == "llama" else None,
        ffn_hidden=80,
        vocab_size=300,
        max_seq_len=12,
        kernels="torch",
        moe_experts=experts,
        moe_every=2,
        moe_ffn_hidden=40,
    )
    eager = build_model(cfg, 0, DEVICE)
    fused = build_model(dataclasses.replace(cfg, kernels="triton", loss_chunk=7), 0, DEVICE)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 300, (2, 6), generator=g).to(DEVICE), torch.randint(0, 300, (2, 6), generator=g).to(DEVICE)
    y[0, :3] = IGNORE_INDEX  # (12 rows: each kernel runs a program per row in Triton's interpreter here)
    ref, loss = eager(x, target=y), fused(x, target=y)
    assert "trickles_linear_cross_entropy" in type(loss.grad_fn).__name__
    _close(loss, ref, torch.float32)
    ref.backward()
    loss.backward()
    assert fused.cfg.fuses_projections and not eager.cfg.fuses_projections
    grads = split_state(fused.cfg, {n: p.grad for n, p in fused.named_parameters()})
    assert set(grads) == {n for n, _ in eager.named_parameters()}
    for name, p in eager.named_parameters():
        scale = max(float(p.grad.abs().max()), 1e-4)  # (gpt2's key bias gets no gradient: zero up to rounding)
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_triton_kernels_under_full_recomputation_and_in_bf16():
    """Recomputed blocks re-run the kernels: the
    same loss and gradients as without recomputation, bit for bit; in bf16 (parameters and compute) the Triton
    model's loss is within bf16 rounding of the eager bf16 model's."""
    from trickles.memory.recompute import apply_recompute

    cfg = ModelConfig(
        n_layers=2,
        d_model=48,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=80,
        vocab_size=300,
        max_seq_len=12,
        kernels="triton",
        loss_chunk=8,
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 300, (2, 6), generator=g).to(DEVICE), torch.randint(0, 300, (2, 6), generator=g).to(DEVICE)
    plain, recomputed = build_model(cfg, 0, DEVICE), build_model(cfg, 0, DEVICE)
    apply_recompute(recomputed, "full")
    a, b = plain(x, target=y), recomputed(x, target=y)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for (name, p), (_, q) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    eager = build_model(dataclasses.replace(cfg, kernels="torch", fused_loss=False), 0, DEVICE).to(torch.bfloat16)
    fused = build_model(cfg, 0, DEVICE).to(torch.bfloat16)
    le, lf = eager(x, target=y), fused(x, target=y)
    le, lf = float(le.detach()), float(lf.detach())
    assert abs(le - lf) <= BF16_TOL * le


def test_triton_kernels_that_cannot_run_are_refused_before_any_process_group(monkeypatch):
    """model.kernels=triton on a CPU without the interpreter, or without Triton, is one clear line; auto and torch run
    anywhere; a negative loss chunk is refused."""
    from trickles import kernels
    from trickles.config import Config
    from trickles.errors import ConfigError

    cfg = Config.load(None, ["model.kernels=triton", "train.device=cpu"])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1.*model.kernels=auto"):
        cfg.validate(1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg.validate(1)
    monkeypatch.setattr(kernels, "HAVE_TRITON", False)
    with pytest.raises(ConfigError, match="needs Triton"):
        Config.load(None, ["model.kernels=triton"]).validate(1)
    for setting in ("auto", "torch"):
        Config.load(None, [f"model.kernels={setting}", "train.device=cpu"]).validate(1)
    with pytest.raises(ConfigError, match="loss_chunk"):
        Config.load(None, ["model.loss_chunk=-1"]).validate(1)
    assert kernels.runs_triton("auto", "cuda", "rotary") is False  # no Triton now: auto falls back
    assert (
        kernels.runs_triton("torch", "cuda", "rotary") is False
        and kernels.runs_triton("triton", "cpu", "rotary") is True
    )


def test_auto_runs_a_kernel_only_where_its_measurement_shows_it_winning(monkeypatch):
    """``auto`` on CUDA: a kernel measured at most eager's and compile's time runs in Triton, one measured slower or not
    measured does not; inside a compiled block only compile's time counts; never on a CPU; an unknown name is an
    error (a typo would otherwise silently pick PyTorch)."""
    from trickles import kernels

    monkeypatch.setattr(kernels, "HAVE_TRITON", True)
    measured = dict.fromkeys(kernels.KERNEL_NAMES)
    measured["rms_norm"] = kernels.Measured(1.0, 1.2, 1.1, 1.3, "test")  # wins both ways
    measured["swiglu"] = kernels.Measured(1.0, 0.9, 1.2, None, "test")  # loses to eager, beats compile
    monkeypatch.setattr(kernels, "MEASURED", measured)
    assert kernels.runs_triton("auto", "cuda", "rms_norm") and not kernels.runs_triton("auto", "cpu", "rms_norm")
    assert not kernels.runs_triton("auto", "cuda", "swiglu") and not kernels.runs_triton("auto", "cuda", "rotary")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert kernels.runs_triton("auto", "cuda", "swiglu") and not kernels.runs_triton("auto", "cuda", "rotary")
    assert kernels.triton_allowed("auto", "cuda") and not kernels.triton_allowed("torch", "cuda")
    with pytest.raises(KeyError, match="unknown kernel 'rmsnorm'"):
        kernels.runs_triton("auto", "cuda", "rmsnorm")
    # the table docs/kernels.md holds says the same: each contestant's time (liger-kernel's where it has one) and what
    # auto runs
    rows = {line.split(" | ")[0].lstrip("| "): line for line in kernels.measured_markdown().splitlines()[2:]}
    assert rows["rms_norm"] == "| rms_norm | 1.000 | 1.200 | 1.100 | 1.300 | Triton | test |"
    assert rows["swiglu"] == "| swiglu | 1.000 | 0.900 | 1.200 | - | Triton in compiled blocks | test |"
    assert rows["rotary"] == "| rotary | - | - | - | - | PyTorch (not measured) | - |"


def test_auto_and_fused_proj_on_a_cuda_machine_follow_the_measured_tables(monkeypatch):
    """On a (faked) CUDA machine with Triton: while the tables are empty, ``auto`` runs PyTorch for every kernel, the
    loss is unfused and ``model.fused_proj`` unset keeps the projections separate; a measured row showing a kernel (or
    the fused projections) winning turns that one on, a losing row does not; ``triton`` opts in whatever the tables
    say, ``torch`` never."""
    from trickles import kernels
    from trickles.kernels.cross_entropy import fused_on

    monkeypatch.setattr(kernels, "HAVE_TRITON", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "MEASURED", dict.fromkeys(kernels.KERNEL_NAMES))
    monkeypatch.setattr(kernels, "MEASURED_PROJECTIONS", None)
    cfg = ModelConfig(kernels="auto")
    assert not any(kernels.runs_triton("auto", "cuda", k) for k in kernels.KERNEL_NAMES)
    assert not fused_on(None, "auto", "cuda") and not cfg.fuses_projections
    assert kernels.auto_triton_kernels() == [] and "PyTorch for every kernel" in kernels.measured_markdown()
    assert dataclasses.replace(cfg, kernels="triton").fuses_projections
    assert not dataclasses.replace(cfg, kernels="torch").fuses_projections
    assert all(kernels.runs_triton("triton", "cuda", k) for k in kernels.KERNEL_NAMES)

    kernels.MEASURED["cross_entropy"] = kernels.Measured(1.0, 1.5, 1.2, None, "test")  # wins
    kernels.MEASURED["rotary"] = kernels.Measured(2.0, 1.5, 1.2, None, "test")  # loses
    assert [k for k in kernels.KERNEL_NAMES if kernels.runs_triton("auto", "cuda", k)] == ["cross_entropy"]
    assert fused_on(None, "auto", "cuda") and not fused_on(None, "auto", "cpu")
    assert "Triton for cross_entropy on CUDA" in kernels.measured_markdown()
    kernels.MEASURED_PROJECTIONS = kernels.MeasuredProjections(1.1, 1.0, "test")  # fused slower: stays separate
    assert not cfg.fuses_projections
    kernels.MEASURED_PROJECTIONS = kernels.MeasuredProjections(0.9, 1.0, "test")
    assert cfg.fuses_projections and not dataclasses.replace(cfg, fused_proj=False).fuses_projections
    assert "| q/k/v, gate/up | 0.900 | 1.000 | yes | test |" in kernels.measured_markdown()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cfg.fuses_projections  # never on a machine without CUDA


def test_the_readme_and_kernels_page_say_what_auto_runs():
    """While no measurement shows a kernel winning, the README's first paragraph says the Triton kernels are opt-in
    (``model.kernels=triton``), and no page calls ``auto`` "Triton on CUDA"."""
    from pathlib import Path

    from trickles import kernels

    root = Path(__file__).resolve().parents[2]
    first = (root / "README.md").read_text(encoding="utf-8").split("\n\n")[1]
    page = (root / "docs" / "kernels.md").read_text(encoding="utf-8")
    assert kernels.measured_markdown() in page
    if not kernels.auto_triton_kernels():
        assert "opt-in (`model.kernels=triton`)" in first, first
        assert "today: PyTorch everywhere" in page and "Triton on CUDA" not in page


def test_elementwise_kernels_write_nothing_past_their_end():
    """2,055 elements (the last 1024-wide block partial) written into views of longer buffers: the elements just past
    the end keep their canary value, forward and backward."""
    from trickles.kernels.activations import gelu_backward, gelu_forward, swiglu_backward, swiglu_forward

    n = 2055
    a, b, dh = (torch.randn(n, generator=torch.Generator().manual_seed(i)).to(DEVICE) for i in range(3))

    def canaried():
        return torch.full((n + 8,), 7.0, device=DEVICE)

    outs = [canaried() for _ in range(6)]
    swiglu_forward(a, b, out=outs[0][:n])
    swiglu_backward(dh, a, b, da=outs[1][:n], db=outs[2][:n])
    gelu_forward(a, out=outs[3][:n])
    gelu_backward(dh, a, da=outs[4][:n])
    for buf in outs[:5]:
        assert torch.equal(buf[n:], outs[5][n:])
    torch.testing.assert_close(outs[0][:n], F.silu(a) * b)
    torch.testing.assert_close(outs[3][:n], F.gelu(a, approximate="tanh"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pytorch_rms_norm_and_swiglu_save_what_the_kernels_save_and_give_autograds_gradients(dtype):
    """``kernels=torch``: RMSNorm keeps its input, weight and fp32 ``1/rms`` only (autograd's own operations would
    keep an fp32 copy and the normalized row too), SwiGLU its two inputs only (not ``silu(a)``); the outputs are
    autograd's bit for bit, SwiGLU's gradients too, RMSNorm's within rounding of its fp32 arithmetic."""

    def saved(fn, *args):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = fn(*args)
        return out, {(t.data_ptr(), t.dtype, tuple(t.shape)) for t in kept}

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 48, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype).requires_grad_()
    y, kept = saved(rms_norm, x, w, 1e-5)
    assert type(y.grad_fn).__name__ == "RMSNormFunctionBackward" and len(kept) == 3
    assert {(dt, shape) for _, dt, shape in kept} == {(dtype, (2, 5, 48)), (dtype, (48,)), (torch.float32, (2, 5, 1))}
    dy = torch.randn(y.shape, generator=g).to(dtype)
    ref = rms_norm_reference(x, w, 1e-5)
    assert torch.equal(y, ref)
    for a, b in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        _close(a, b, dtype)
    a, b = (torch.randn(4, 40, generator=g).to(dtype).requires_grad_() for _ in range(2))
    h, kept = saved(swiglu, a, b)
    assert type(h.grad_fn).__name__ == "SwiGLUFunctionBackward"
    assert kept == {(t.data_ptr(), dtype, (4, 40)) for t in (a, b)}
    dh = torch.randn(h.shape, generator=g).to(dtype)
    eager = F.silu(a) * b
    assert torch.equal(h, eager)
    for u, v in zip(torch.autograd.grad(h, (a, b), dh), torch.autograd.grad(eager, (a, b), dh)):
        assert torch.equal(u, v)
