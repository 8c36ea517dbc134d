"""One block of ring attention (:mod:`trickles.parallel.ring`): a query chunk against a key chunk, forward to
``(O_b, lse_b)`` and backward from the final ``O`` and ``lse``, on the fastest kernel the device has.

Every kernel here computes the same two things. Forward: ``O_b = softmax(S_b) V_b`` and ``lse_b = log sum exp S_b``
per query row (fp32), ``S_b = Q K_b^T / sqrt(D)``, causal on a diagonal block, ``-inf`` where a packed document's
:class:`BlockMask` hides a key; a row that sees no key of the block gives ``O_b = 0`` and ``lse_b = -inf``, so the
ring's merge ignores it. Backward, from the final output ``O``, its ``lse`` and ``dO`` (the block's share of the
final softmax is ``P = exp(S_b - lse)``): ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO O))``,
``dQ = dS K / sqrt(D)``, ``dK = dS^T Q / sqrt(D)``, returned in fp32 for the ring to sum (``delta = rowsum(dO O)``
is given to a kernel whose ``takes_delta`` says so; the fused kernels compute it themselves). ``dO`` comes in the
output's type.

* :class:`CpuFlash` (a CPU): PyTorch's fused flash kernel for CPUs, ``_scaled_dot_product_flash_attention_for_cpu``
  and its backward; it takes the mask in additive form and reports a row that sees no key with ``lse`` 0, made
  ``-inf`` here.
* :class:`CudaEfficient` (CUDA): the memory-efficient kernel, ``_scaled_dot_product_efficient_attention`` and its
  backward, which take an additive bias (fp32, fp16, bf16 alike) and return the log-sum-exp. Its contract, kept
  here: the bias's rows start at multiples of 16 elements (it is built 16-aligned and sliced, as SDPA pads it), its
  ``lse`` comes back padded to a multiple of 32 rows (sliced) and goes into backward padded so again (zeros past
  the rows), dropout is 0 so the random seed and offset it takes are never read, and a row that sees no key may
  come back as anything (set to ``0`` and ``-inf``). A block the kernel does not take (a head dimension not a
  multiple of 8 or over 256, a type other than fp32, fp16 and bf16) runs :class:`Matmul`.
* :class:`Matmul` (anywhere): the formulas as fp32 matmuls, ``[c, c]`` scores materialized; the reference the
  fused kernels are tested against, and the fallback.
"""

from __future__ import annotations

import torch


class BlockMask:
    """One ring block's same-document mask ``[B, 1, c, c]`` (True: the query sees the key), with what the kernels
    take: the additive form in the inputs' type (cached), and which query rows see any key at all."""

    def __init__(self, mask: torch.Tensor):
        self.mask, self.rows = mask, mask.any(-1)  # [B, 1, c]
        self._additive: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def additive(self, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
        """``0`` where the query sees the key, ``-inf`` elsewhere; with ``align``, a view whose rows start at
        multiples of ``align`` elements (the storage padded past the last key)."""
        if (dtype, align) not in self._additive:
            b, one, c, k = self.mask.shape
            wide = -(-k // align) * align
            bias = torch.zeros((b, one, c, wide), dtype=dtype, device=self.mask.device)
            bias[..., :k].masked_fill_(~self.mask, float("-inf"))
            self._additive[(dtype, align)] = bias[..., :k]
        return self._additive[(dtype, align)]


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the rows that see no key yet (``-inf``) set to 0, so that ``exp(s - lse)`` is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Folds a block's ``o_b [B, H, n, D]``, ``lse_b [B, H, n]`` into the running ``out``, ``lse`` (views of the
    accumulators, updated in place): with ``lse' = logaddexp(lse, lse_b)`` the new output is
    ``out exp(lse - lse') + o_b exp(lse_b - lse') = out + (o_b - out) sigmoid(lse_b - lse)``, one ``lerp``; a row
    that has seen no key yet (``lse = -inf``) takes ``o_b``, a row the block shows no key keeps ``out``, and one
    that has seen none in either (both ``-inf``, weight NaN) stays 0."""
    weight = torch.sigmoid(lse_b - lse).nan_to_num_(0.0)
    out.lerp_(o_b, weight[..., None])
    torch.logaddexp(lse, lse_b, out=lse)


def _scores(q, k, scale, causal, mask: BlockMask | None = None):
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal:  # a diagonal block: query i sees keys 0..i
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    if mask is not None:  # packed documents: query i sees key j of its own document only
        s.masked_fill_(~mask.mask, float("-inf"))
    return s


class Matmul:
    """The block's formulas as fp32 matmuls (module docstring)."""

    takes_delta = True

    @staticmethod
    def forward(q, k, v, scale, causal, mask: BlockMask | None = None):
        s = _scores(q, k, scale, causal, mask)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - finite(lse)[..., None])
        return torch.matmul(p.to(v.dtype), v).float(), lse

    @staticmethod
    def backward(q, k, v, do, out, lse, delta, scale, causal, mask: BlockMask | None = None):
        q, k, v, do = q.float(), k.float(), v.float(), do.float()
        p = torch.exp(_scores(q, k, scale, causal, mask) - lse[..., None])
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta[..., None])
        return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


class Capped:
    """Soft-capped scores (``model.attn_softcap``, Gemma 2), which no fused kernel takes: the block's formulas as fp32
    matmuls on the capped scores ``C = cap tanh(S / cap)``. Forward ``O_b = softmax(C) V_b``, ``lse_b`` of ``C``;
    backward as :class:`Matmul` with ``P = exp(C - lse)`` and the cap's derivative on ``dS``:
    ``dS = P (dO V^T - rowsum(dO O)) (1 - (C / cap)^2)``."""

    takes_delta = True

    def __init__(self, cap: float):
        self.cap = float(cap)

    def _capped(self, q, k, scale, causal, mask):
        s = torch.tanh(torch.matmul(q.float(), k.float().transpose(-1, -2)) * (scale / self.cap))
        c = s * self.cap
        if causal:
            c.masked_fill_(torch.ones(c.shape[-2:], dtype=torch.bool, device=c.device).triu_(1), float("-inf"))
        if mask is not None:
            c.masked_fill_(~mask.mask, float("-inf"))
        return c, s

    def forward(self, q, k, v, scale, causal, mask: BlockMask | None = None):
        c, _ = self._capped(q, k, scale, causal, mask)
        lse = torch.logsumexp(c, dim=-1)
        p = torch.exp(c - finite(lse)[..., None])
        return torch.matmul(p, v.float()), lse

    def backward(self, q, k, v, do, out, lse, delta, scale, causal, mask: BlockMask | None = None):
        q, k, v, do = q.float(), k.float(), v.float(), do.float()
        c, t = self._capped(q, k, scale, causal, mask)
        p = torch.exp(c - lse[..., None])
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta[..., None]) * (1 - t * t)
        return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


class CpuFlash:
    """PyTorch's fused flash attention for CPUs (module docstring)."""

    takes_delta = False

    @staticmethod
    def forward(q, k, v, scale, causal, mask: BlockMask | None = None):
        extra = {} if mask is None else {"attn_mask": mask.additive(q.dtype)}
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale, **extra)
        if mask is not None:  # the kernel gives a row that sees no key 0 and log-sum-exp 0: make it -inf
            lse = lse.masked_fill(~mask.rows, float("-inf"))
        return o.float(), lse.float()

    @staticmethod
    def backward(q, k, v, do, out, lse, delta, scale, causal, mask: BlockMask | None = None):
        extra = {} if mask is None else {"attn_mask": mask.additive(q.dtype)}
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.to(q.dtype), q, k, v, out, lse, 0.0, causal, scale=scale, **extra
        )
        return tuple(g.float() for g in grads)


class CudaEfficient:
    """PyTorch's memory-efficient attention on CUDA, through the contract of the module docstring. ``forward_op``,
    ``backward_op``: the kernels (PyTorch's by default; the tests give stand-ins that keep the same contract)."""

    ALIGN_BIAS, ALIGN_LSE = 16, 32
    takes_delta = False

    def __init__(self, forward_op=None, backward_op=None):
        self.forward_op = forward_op or torch.ops.aten._scaled_dot_product_efficient_attention.default
        self.backward_op = backward_op or torch.ops.aten._scaled_dot_product_efficient_attention_backward.default

    def _bias(self, q, mask: BlockMask | None):
        if mask is None:
            return None
        return mask.additive(q.dtype, self.ALIGN_BIAS).expand(q.shape[0], q.shape[1], q.shape[2], -1)

    def forward(self, q, k, v, scale, causal, mask: BlockMask | None = None):
        o, lse, _, _ = self.forward_op(q, k, v, self._bias(q, mask), True, 0.0, causal, scale=scale)
        o, lse = o.float(), lse[..., : q.shape[2]].float()
        if mask is not None:  # a row that sees no key: whatever the kernel made of it, 0 and -inf
            o = o.masked_fill(~mask.rows[..., None], 0.0)
            lse = lse.masked_fill(~mask.rows, float("-inf"))
        return o, lse

    def backward(self, q, k, v, do, out, lse, delta, scale, causal, mask: BlockMask | None = None):
        b, h, rows = lse.shape
        padded = torch.zeros(
            (b, h, -(-rows // self.ALIGN_LSE) * self.ALIGN_LSE), dtype=torch.float32, device=lse.device
        )
        padded[..., :rows] = lse
        unused = torch.zeros((), dtype=torch.int64, device=q.device)  # the seed and offset of dropout 0
        grads = self.backward_op(
            do.to(q.dtype).contiguous(),
            q,
            k,
            v,
            self._bias(q, mask),
            out,
            padded,
            unused,
            unused,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return tuple(g.float() for g in grads[:3])


def kernel_for(q: torch.Tensor):
    """The kernel a block of ``q [B, H, c, D]`` runs (module docstring)."""
    if q.device.type == "cpu":
        return CpuFlash
    d, types = q.shape[-1], (torch.float32, torch.float16, torch.bfloat16)
    if q.device.type == "cuda" and q.dtype in types and d % 8 == 0 and d <= 256:
        return CudaEfficient()
    return Matmul
