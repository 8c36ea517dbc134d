"""The output projection and cross-entropy, fused chunk by chunk: the logits ``[tokens, vocab]`` never exist whole.

With hidden states ``h [N, d]``, the output weight ``W [V, d]`` (optional bias), targets ``t [N]`` (``-100``:
ignored) and ``n`` the targets not ignored, the loss is ``L = (1/n) sum_i (lse_i - z_{i, t_i})`` over the
kept rows, ``z = h W^T + b``, ``lse_i = log sum_j exp z_ij``. Its gradients are
``dz = (softmax(z) - onehot(t)) / n`` (zero on ignored rows), ``dh = dz W``, ``dW = dz^T h``, ``db = sum_i dz_i``.

:func:`linear_cross_entropy` walks the ``N`` rows ``c`` at a time. For each chunk it computes
``z_c = h_c W^T`` (in the autocast type when autocast is on, as the output layer would), the row
statistics in fp32 (max ``m``, ``s = sum exp(z - m)``), the loss rows, and -- in the same forward,
while ``z_c`` is at hand -- turns ``z_c`` into ``dz_c`` in place and adds ``dz_c W`` into ``dh`` and
``dz_c^T h_c`` into an fp32 ``dW``. Backward only scales the saved ``dh``, ``dW`` (and ``db``) by the
incoming gradient. Forward + backward cost three ``N x d x V`` matmuls, as unfused; what stays alive
is ``dh`` (``p N d``, fp32 under fp16 so that loss scaling can rescue small values) and the fp32
``dW`` (``4 V d``) instead of the fp32 log-probabilities (``4 N V``) and, in backward, two more
``[N, V]`` fp32 gradients (see :mod:`trickles.memory.activations`). The transient is one chunk's
logits: ``c V`` in the compute type plus, on the PyTorch path in low precision, their fp32 copy
(from which ``dW``'s chunk product is taken in fp32) and its cast back; the chunk defaults to
``c = 2^ceil(log2(N / ceil(V / d)))`` tokens (liger-kernel's rule: a chunk's logits about as large as the hidden
states ``N d``), but at least :data:`MIN_CHUNK` (smaller matmuls cost more in overhead than they save: 16-token
chunks were 1.6x the unfused loss's time on a CPU at ``d = 256``, 64-token ones 0.84x, ``benchmarks/kernels.py``).

**Vocabulary parallel** (``comm``: the tensor-parallel group, this rank holding rows
``[vocab_start, vocab_start + V/tp)`` of ``W``): per chunk, the row maxima are all-reduced (max), then
each rank's ``s`` rescaled to the global maximum and the target's logit (zero where another rank
holds it) are all-reduced together (sum): two all-reduces, ``4c + 8c`` bytes of payload, per chunk.
The loss is then complete on every rank; ``dz`` and ``dW`` are this rank's vocabulary slice and
``dh`` its partial sum, completed by the all-reduce (or reduce-scatter) the region's entry runs in
backward -- exactly as for the unfused vocabulary-parallel loss.

**Triton** (``model.kernels``): one kernel per chunk works on ``z_c`` in its own type (no fp32 copy): each
program reads its row once for the online max and sum of exponentials, takes the target's logit and the
row's loss, and reads it again to overwrite it with ``(exp(z - lse) - onehot) / n`` (liger-kernel's
scheme). The matmuls stay cuBLAS's: ``dh``'s rows are written in place (``mm(..., out=)``), and ``dW``'s
chunk products are made in the compute type and, on a GPU whose ``addmm`` takes ``out_dtype`` (torch >= 2.8),
summed into the fp32 ``dW`` as they are made; elsewhere each product is rounded once to the compute type
before it joins the sum. Vocabulary-parallel, the statistics and the gradient are two kernels with the
all-reduces between them.

**Soft-capped logits** (``model.final_softcap``, Gemma 2): each chunk's logits are capped, ``c = cap tanh(z / cap)``,
before the statistics, and its gradient multiplied by ``1 - tanh^2`` before the matmuls
(:mod:`trickles.kernels.softcap`): the chunk's transient grows by its ``tanh`` in the compute type, ``c V p``.

**As an operator**: the loss is the custom operator ``trickles::linear_cross_entropy``, which returns the loss and
the three gradients (0-element tensors where not needed); its registered backward scales them by the incoming
gradient, in place when eager. Vocabulary-parallel, the operator takes the group by name
(:mod:`trickles.kernels.groups`) and runs the all-reduces through the communicator registered under it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import HAVE_TRITON, runs_triton, use_triton, warps
from .groups import comm_name, named_comm
from .softcap import cap_chunk, softcap, uncap_grad

IGNORE_INDEX = -100

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _online_max_sum(base, V, BLOCK: tl.constexpr):
        """A row's maximum and sum of exponentials relative to it, in one pass over its ``V`` columns (fp32)."""
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        return m, s

    @triton.jit
    def _write_grad(base, V, lse, idx, scale, BLOCK: tl.constexpr):
        """Overwrites a row of logits with ``(exp(z - lse) - onehot(idx)) * scale`` in their own type."""
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - tl.where(cols == idx, 1.0, 0.0)
            tl.store(base + cols, (g * scale).to(base.dtype.element_ty), mask=mask)

    @triton.jit
    def _row_stats(Z, M, S, stride, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        m, s = _online_max_sum(Z + row * stride, V, BLOCK)
        tl.store(M + row, m)
        tl.store(S + row, s)

    @triton.jit
    def _row_grad(Z, LSE, IDX, SCALE, stride, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # IDX: the target's local column, -1 where this rank does not hold it
        _write_grad(Z + row * stride, V, tl.load(LSE + row), tl.load(IDX + row), tl.load(SCALE + row), BLOCK)

    @triton.jit
    def _loss_grad(Z, IDX, SCALE, LOSS, stride, V, GRAD: tl.constexpr, BLOCK: tl.constexpr):
        """One row of a chunk's logits, read twice and written once: the online max and sum of exponentials, the
        row's loss ``lse - z_t`` (0 where ignored), then (``GRAD``) ``(softmax - onehot) * scale`` in place."""
        row = tl.program_id(0)
        base = Z + row * stride
        idx = tl.load(IDX + row)  # the target's column, -1 where ignored
        m, s = _online_max_sum(base, V, BLOCK)
        lse = m + tl.log(s)
        picked = tl.load(base + tl.maximum(idx, 0)).to(tl.float32)
        tl.store(LOSS + row, tl.where(idx >= 0, lse - picked, 0.0))
        if GRAD:
            _write_grad(base, V, lse, idx, tl.load(SCALE + row), BLOCK)


MIN_CHUNK = 64


def default_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """liger-kernel's rule, ``2^ceil(log2(N / ceil(V / d)))`` tokens, so a chunk's logits are about ``N d``; at least
    :data:`MIN_CHUNK`, at most ``N``."""
    per = max(1, math.ceil(tokens / max(1, math.ceil(vocab / hidden))))
    return min(tokens, max(MIN_CHUNK, 1 << (per - 1).bit_length()))


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return torch.promote_types(h.dtype, weight.dtype)


def fp32_accumulating_mm(device_type: str) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` adds a low-precision product into an fp32 tensor on a
    device of type ``device_type`` (CUDA, torch >= 2.8). Where such a device is present it is checked once against the
    product computed in fp32, so a build that lacks it, or gets it wrong, takes the product-then-add path; elsewhere
    (the memory report planning for a GPU from a CPU) the build's having the operator answers."""
    if device_type not in _FP32_MM:
        ok = device_type == "cuda" and hasattr(torch.ops.aten.addmm, "dtype_out")
        if ok and torch.cuda.is_available():
            ok = _probe_fp32_mm(torch.device("cuda"))
        _FP32_MM[device_type] = ok
    return _FP32_MM[device_type]


_FP32_MM: dict[str, bool] = {}


def _probe_fp32_mm(device: torch.device) -> bool:
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=g).to(device, torch.bfloat16) for s in ((64, 48), (48, 32)))
    acc = torch.ones(32, 32, device=device)
    try:
        torch.addmm(acc, a.t()[:32, :], b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    expected = 1.0 + a.t()[:32, :].float() @ b.float()
    return bool(torch.allclose(acc, expected, rtol=1e-3, atol=1e-3))


def _dh_dtype(h: torch.Tensor) -> torch.dtype:
    """The type ``dh`` is kept in until backward: ``h``'s, but fp32 for fp16 (it waits for the loss-scaled gradient)."""
    return torch.float32 if h.dtype == torch.float16 else h.dtype


def _chunked(h, weight, bias, target, chunk, cd, comm, vocab_start, triton_rows, need_h, need_w, need_b, cap=None):
    """The loss and (where needed) ``dh``, ``dW``, ``db`` already divided by the count of kept targets (module
    docstring), walking ``h``'s rows ``chunk`` at a time; ``cap``: the logits soft-capped first."""
    n_rows, v_local = h.shape[0], weight.shape[0]
    device = h.device
    valid = target != IGNORE_INDEX
    inv_n = 1.0 / valid.sum(dtype=torch.float32).clamp(min=1.0)
    inside = valid & (target >= vocab_start) & (target < vocab_start + v_local)
    idx = (target - vocab_start).masked_fill(~inside, -1)  # the target's local column, -1 where this rank has none
    gather_idx = idx.clamp(min=0)[:, None]
    row_scale = valid.float() * inv_n  # each kept row's share of the mean
    store = _dh_dtype(h)
    dh = torch.empty(h.shape, dtype=store, device=device) if need_h else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
    db = torch.zeros(v_local, dtype=torch.float32, device=device) if need_b else None
    grads = need_h or need_w or need_b
    w = weight.to(cd)
    b = bias.to(cd) if bias is not None else None
    one_kernel = triton_rows and comm is None  # loss and gradient in one pass over the rows, no exchange between
    accumulate_fp32 = need_w and cd != torch.float32 and triton_rows and fp32_accumulating_mm(device.type)
    losses = torch.empty(n_rows, dtype=torch.float32, device=device) if one_kernel else None
    total = torch.zeros((), dtype=torch.float32, device=device)
    for s in range(0, n_rows, chunk):
        e = min(s + chunk, n_rows)
        hc = h[s:e].to(cd)
        z = F.linear(hc, w, b)
        zf = th = None
        if cap is not None:
            th, z = cap_chunk(z, cap)
        if one_kernel:
            block = min(4096, triton.next_power_of_2(v_local))
            _loss_grad[(e - s,)](
                z,
                idx[s:e],
                row_scale[s:e],
                losses[s:e],
                z.stride(0),
                v_local,
                GRAD=grads,
                BLOCK=block,
                num_warps=warps(block),
            )
            g = z if th is None or not grads else uncap_grad(z, th)
        else:
            picked = z.gather(1, gather_idx[s:e]).squeeze(1).float().masked_fill(~inside[s:e], 0.0)
            if triton_rows:
                m, se = (torch.empty(e - s, dtype=torch.float32, device=device) for _ in range(2))
                block = min(4096, triton.next_power_of_2(v_local))
                _row_stats[(e - s,)](z, m, se, z.stride(0), v_local, BLOCK=block, num_warps=warps(block))
            else:
                zf = z.float()  # z itself in fp32
                m = zf.amax(dim=1)
                se = zf.sub_(m[:, None]).exp_().sum(dim=1)  # zf now holds exp(z - m)
            m_local = m
            if comm is not None:
                m = m_local.clone()
                comm.all_reduce(m, op="max")
                sums = torch.stack([se * torch.exp(m_local - m), picked])
                comm.all_reduce(sums)
                se, picked = sums[0], sums[1]
            lse = m + se.log()
            total += ((lse - picked) * valid[s:e]).sum()
            if not grads:
                continue
            if triton_rows:
                g = z
                _row_grad[(e - s,)](
                    g, lse, idx[s:e], row_scale[s:e], g.stride(0), v_local, BLOCK=block, num_warps=warps(block)
                )
                g = g if th is None else uncap_grad(g, th)
            else:
                zf.mul_((torch.exp(m_local - lse) * row_scale[s:e])[:, None])  # softmax / n on the kept rows
                zf.scatter_add_(1, gather_idx[s:e], -(inside[s:e].float() * row_scale[s:e])[:, None])
                g = (zf if th is None else uncap_grad(zf, th)).to(cd)
        if dh is not None:
            if dh.dtype == cd:
                torch.mm(g, w, out=dh[s:e])  # straight into the rows of dh
            else:
                dh[s:e] = g @ w
        if dw is not None:
            if cd == torch.float32:
                dw.addmm_(g.t(), hc)
            elif accumulate_fp32:  # the product in the compute type (tensor cores), summed into fp32 as it is made
                torch.addmm(dw, g.t(), hc, out_dtype=torch.float32, out=dw)
            elif triton_rows:  # each chunk's product in the compute type, added to the fp32 sum
                dw += g.t() @ hc
            else:  # the fp32 gradient is at hand: an fp32 product, no rounding per chunk
                dw.addmm_(zf.t(), hc.float())
        if db is not None:
            db += g.float().sum(0)
        z = zf = g = th = None  # let this chunk's logits go before the next chunk's are allocated
    if one_kernel:
        total = losses.sum()
    return total * inv_n, dh, dw, db


def _scaled(t: torch.Tensor | None, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A saved gradient times the incoming one, in the type of its input. Eagerly in place (the saved gradient is not
    needed after, and a copy of the fp32 ``dW`` would add ``4 V d`` bytes at the start of backward); when AOTAutograd
    traces the backward (its tensors are functional or fake subclasses, not plain tensors) out of place, since a
    traced graph may not write into its inputs -- Inductor then plans the buffer."""
    if t is None:
        return None
    if type(t) is torch.Tensor and type(grad) is torch.Tensor:
        return t.mul_(grad.to(t.dtype)).to(dtype)
    return (t * grad.to(t.dtype)).to(dtype)


@torch.library.custom_op("trickles::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    chunk: int,
    compute_dtype: torch.dtype,
    triton_rows: bool,
    need_h: bool,
    need_w: bool,
    need_b: bool,
    group: str | None = None,
    vocab_start: int = 0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean loss over ``h [N, d]``'s rows and its gradients for ``h``, ``weight`` and ``bias`` (each a 0-element
    tensor where not needed, of the type it would have), computed together chunk by chunk (module docstring). Types:
    the loss, ``dW`` and ``db`` fp32; ``dh`` ``h``'s, fp32 for an fp16 ``h``. ``group``: the tensor-parallel group's
    name (:func:`~trickles.kernels.groups.comm_name`), ``weight`` holding vocabulary rows from ``vocab_start``;
    ``softcap``: the logits capped to ``softcap * tanh(z / softcap)`` first."""
    comm = None if group is None else named_comm(group)
    loss, dh, dw, db = _chunked(
        h, weight, bias, target, chunk, compute_dtype, comm, vocab_start, triton_rows, need_h, need_w, need_b, softcap
    )
    types = (_dh_dtype(h), torch.float32, torch.float32)  # (no two outputs may share storage)
    return loss, *(h.new_empty(0, dtype=dt) if t is None else t for t, dt in zip((dh, dw, db), types))


@linear_cross_entropy_op.register_fake
def _(h, weight, bias, target, chunk, cd, triton_rows, need_h, need_w, need_b, group=None, vocab_start=0, softcap=None):
    store = _dh_dtype(h)
    return (
        h.new_empty((), dtype=torch.float32),
        h.new_empty(h.shape if need_h else (0,), dtype=store),
        h.new_empty(weight.shape if need_w else (0,), dtype=torch.float32),
        h.new_empty(weight.shape[:1] if need_b else (0,), dtype=torch.float32),
    )


def _ce_setup(ctx, inputs, output):
    h, weight, bias = inputs[:3]
    ctx.needs = inputs[7:10]  # need_h, need_w, need_b
    ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.save_for_backward(*output[1:])


def _ce_backward(ctx, grad, *_):
    saved = [t if need else None for t, need in zip(ctx.saved_tensors, ctx.needs)]
    out_h, out_w, out_b = (_scaled(t, grad, dtype) for t, dtype in zip(saved, ctx.dtypes))
    return out_h, out_w, out_b, *(None,) * 10


linear_cross_entropy_op.register_autograd(_ce_backward, setup_context=_ce_setup)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk: int = 0,
    kernels: str = "torch",
    comm=None,
    vocab_start: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy of ``h [..., d] W^T + b`` (capped to ``softcap * tanh(z / softcap)`` where given)
    against ``target [...]`` (module docstring), chunk by chunk.

    ``chunk``: tokens per chunk (0: :func:`default_chunk`). ``comm``, ``vocab_start``: the tensor-parallel
    group and this rank's first vocabulary id when ``weight`` holds a slice of the vocabulary
    (anything with ``all_reduce(tensor, op=...)``, e.g. :class:`~trickles.comm.GroupComm`).
    """
    h2 = h.reshape(-1, h.shape[-1])
    t = target.reshape(-1).to(h.device)
    if h2.shape[0] != t.shape[0]:
        raise ValueError(f"fused cross-entropy: {h2.shape[0]} hidden rows but {t.shape[0]} targets")
    vocab = weight.shape[0] * (getattr(comm, "size", 1) if comm is not None else 1)
    chunk = chunk or default_chunk(h2.shape[0], vocab, h2.shape[1])
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    cd, triton_rows = _compute_dtype(h, weight), use_triton(kernels, h, "cross_entropy")
    need_b = grads and bias is not None and bias.requires_grad
    need_h, need_w = grads and h.requires_grad, grads and weight.requires_grad
    group = None if comm is None else comm_name(comm)
    return linear_cross_entropy_op(
        h2, weight, bias, t, chunk, cd, triton_rows, need_h, need_w, need_b, group, vocab_start, softcap
    )[0]


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The unfused reference: mean token cross-entropy of the fp32 logits (``-100`` targets ignored; 0 when every
    target is, as the fused and vocabulary-parallel losses: a chat micro-batch's slice may hold no assistant token)."""
    t = target.flatten().to(logits.device)
    return F.cross_entropy(logits.float().flatten(0, -2), t, reduction="sum") / (t != IGNORE_INDEX).sum().clamp(min=1)


def fused_on(fused: bool | None, kernels: str, device_type: str) -> bool:
    """Whether the loss is fused: ``model.fused_loss`` when set, else whether ``model.kernels`` runs the Triton
    cross-entropy there."""
    return runs_triton(kernels, device_type, "cross_entropy") if fused is None else fused


class OutputLoss(nn.Module):
    """The loss head of a model: the output projection's mean token cross-entropy, fused or not. ``fused``: True,
    the chunked :func:`linear_cross_entropy`; False, the logits then :func:`cross_entropy` (on a CPU, of the rows
    whose target counts only); None, fused when ``kernels`` runs Triton on the input's device. ``softcap``: the
    logits capped first (``model.final_softcap``). No parameters of its own: it uses the output layer's. A
    tensor-parallel plan replaces it with its vocabulary-parallel counterpart."""

    def __init__(self, fused: bool | None = None, chunk: int = 0, kernels: str = "torch", softcap: float | None = None):
        super().__init__()
        self.fused, self.chunk, self.kernels, self.softcap = fused, chunk, kernels, softcap

    def is_fused(self, h: torch.Tensor) -> bool:
        return fused_on(self.fused, self.kernels, h.device.type)

    def forward(self, h: torch.Tensor, output: nn.Module, target: torch.Tensor) -> torch.Tensor:
        if self.is_fused(h):
            bias = getattr(output, "bias", None)
            return linear_cross_entropy(h, output.weight, target, bias, self.chunk, self.kernels, softcap=self.softcap)
        keep = None if h.device.type != "cpu" or torch.compiler.is_compiling() else target.flatten() != IGNORE_INDEX
        if keep is not None and not keep.all():  # a loss mask on a CPU (no device sync): the trained rows' logits only
            h, target = h.flatten(0, -2)[keep], target.flatten()[keep]
        return cross_entropy(softcap(output(h), self.softcap), target)
