"""Symmetric int8 quantization: the math, the int8 linear, and swapping a model's projections for it.

**Weights.** A weight ``W [n, k]`` becomes ``W_q = round(W / s_w)`` in ``[-127, 127]`` (int8; -128 unused, so the
range is symmetric) with ``s_w = max |W| / 127`` -- one scale per output row (``granularity="row"``, the default:
a row with small weights keeps its resolution when another row has an outlier) or one for the whole matrix
(``"tensor"``). Rounding to nearest puts every element within half a step: ``|W - s_w W_q| <= s_w / 2``. An
all-zero row gets ``s_w = 1`` (its codes are zero either way).

**Activations** (true int8 only): each token's input row ``x [k]`` is quantized on the fly the same way,
``x_q = round(x / s_x)``, ``s_x = max |x| / 127`` (per token), so ``|x - s_x x_q| <= s_x / 2``.

**The matmul.** Weight-only (``mode="weight"``): ``y = (x W_q^T) * s_w + b`` -- the int8 codes are widened in the matmul
and the per-row scale applied once to the output. True int8 (``mode="full"``): ``acc = x_q W_q^T`` in int32 (exact) with
``torch._int_mm``, then one rescale ``y = acc * s_x s_w^T + b``. Against the float product ``x W^T`` the error of output
``j`` of a token is bounded by the two rounding errors and their product::

    |y_j - (x W^T)_j| <= sum_k ( |x_k| s_w,j / 2 + |W_jk| s_x / 2 + s_x s_w,j / 4 )

(write ``x = s_x x_q + e_x``, ``W_j = s_w,j W_q,j + e_w`` and expand ``x W_j^T``: the cross terms are
``x_k e_w,k``, ``e_x,k W_jk``, and ``-e_x,k e_w,k``, each bounded by the half steps; :func:`error_bound`).

``torch._int_mm`` takes any shape on CPU; on CUDA it needs ``k`` and ``n`` multiples of 8 and more than 16 rows
(fewer rows are padded with zeros). Where it cannot run (other devices, CUDA shapes it refuses) the int32 product
is computed exactly in floating point instead -- fp32 while ``k 127^2 < 2^24``, else fp64 -- and
:attr:`Int8Linear.path` says which ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127
GRANULARITIES = ("row", "tensor")
MODES = ("weight", "full")
#: the projections quantized (attention and dense MLP), with the output head unless it is tied to the embedding;
#: embeddings, norms, experts and routers stay float
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")


def scales(w: torch.Tensor, granularity: str = "row", bits: int = 8) -> torch.Tensor:
    """``s_w [n]``: max |W| / 127 of each row (``row``) or of the matrix repeated per row (``tensor``); zero -> 1.

    ``bits < 8``: the grid of ``2^(bits-1) - 1`` steps each way (still stored as int8; for studying granularity)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    w = w.detach().float()
    amax = w.abs().amax(dim=1) if granularity == "row" else w.abs().amax().expand(w.shape[0])
    return scale_of(amax, 2 ** (bits - 1) - 1)


def scale_of(amax: torch.Tensor, qmax: int = QMAX) -> torch.Tensor:
    """The symmetric grid's step for each largest magnitude ``amax``: ``amax / qmax``, and 1 where ``amax`` is 0."""
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_weight(w: torch.Tensor, granularity: str = "row", bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_q int8 [n, k], s_w fp32 [n])`` with ``W ~= s_w[:, None] * W_q``."""
    s = scales(w, granularity, bits)
    top = 2 ** (bits - 1) - 1
    q = torch.round(w.detach().float() / s[:, None]).clamp_(-top, top).to(torch.int8)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s[:, None]


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q int8 [m, k], s_x fp32 [m])`` for rows ``x [m, k]``: one symmetric scale per token.

    ``|x / s_x| <= 127`` by construction, so no clamp is needed; an all-zero token gets a tiny scale and zero codes
    (the fewest operations: this runs on every token of every projection)."""
    x = x.detach().float()
    s = x.abs().amax(dim=-1, keepdim=True).div_(QMAX).clamp_min_(1e-30)
    return torch.round(x / s).to(torch.int8), s.squeeze(-1)


def int_mm_path(m: int, k: int, n: int, device: torch.device) -> str:
    """Which integer product :func:`int8_matmul` runs for ``[m, k] x [k, n]`` on ``device``."""
    if hasattr(torch, "_int_mm") and device.type == "cpu":
        return "int_mm"
    if hasattr(torch, "_int_mm") and device.type == "cuda" and k % 8 == 0 and n % 8 == 0 and k >= 16:
        return "int_mm" if m > 16 else "int_mm_padded"
    return "fp32_exact" if k * QMAX * QMAX < 2**24 else "fp64_exact"


def int8_matmul(xq: torch.Tensor, wq_t: torch.Tensor, path: str) -> torch.Tensor:
    """The exact int32 product ``x_q [m, k] @ W_q^T [k, n]`` by ``path`` (see :func:`int_mm_path`)."""
    if path == "int_mm":
        return torch._int_mm(xq, wq_t)
    if path == "int_mm_padded":
        m = xq.shape[0]
        return torch._int_mm(F.pad(xq, (0, 0, 0, 17 - m)), wq_t)[:m]
    dtype = torch.float32 if path == "fp32_exact" else torch.float64
    return (xq.to(dtype) @ wq_t.to(dtype)).to(torch.int32)


def error_bound(x: torch.Tensor, w: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """``[m, n]``: the bound on ``|true int8 - x W^T|`` from the module docstring, per token and output."""
    x, w = x.float(), w.float()
    k = x.shape[-1]
    return (
        x.abs().sum(-1, keepdim=True) * s_w[None, :] / 2
        + s_x[:, None] * w.abs().sum(-1)[None, :] / 2
        + k * s_x[:, None] * s_w[None, :] / 4
    )


class Int8Linear(nn.Module):
    """A linear layer holding ``weight`` as int8 codes and ``weight_scale [n]`` (fp32), bias (if any) in float.

    ``mode="weight"``: weight-only int8 (activations stay float); ``"full"``: activations quantized per token and an
    integer matmul (see the module docstring). The buffers are named like the float layer's parameters so a
    quantized checkpoint keeps the float model's names.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, mode: str = "weight", device=None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, device=device))
        else:
            self.bias = None
        self.path = None  # the integer product's path of the last true-int8 forward
        self._wq_t = None  # W_q^T contiguous, cached for torch._int_mm

    @classmethod
    def from_float(cls, linear: nn.Module, granularity: str = "row", mode: str = "weight", bits: int = 8) -> Int8Linear:
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, mode, device=linear.weight.device)
        q, s = quantize_weight(linear.weight, granularity, bits)
        out.weight.copy_(q)
        out.weight_scale.copy_(s)
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach())
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8={self.mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.mode == "weight":
            y = self._weight_only(x2)
        else:
            xq, sx = quantize_tokens(x2)
            self.path = int_mm_path(*xq.shape, self.out_features, x.device)
            if self._wq_t is None or self._wq_t.device != x.device:
                self._wq_t = self.weight.t().contiguous()
            acc = int8_matmul(xq, self._wq_t, self.path)
            y = (acc * (sx[:, None] * self.weight_scale)).to(x.dtype)  # int32 * fp32 -> fp32: one operation
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _weight_only(self, x2: torch.Tensor) -> torch.Tensor:
        # the codes widened inside the matmul's operand, the scale once on the output (torch._weight_int8pack_mm, the
        # fused CPU kernel, measured 2-8x slower than this on a CPU without VNNI)
        return F.linear(x2, self.weight.to(x2.dtype)).mul_(self.weight_scale.to(x2.dtype))


def quantized_names(model: nn.Module) -> list[str]:
    """The module names of ``model``'s projections that quantization replaces (dense blocks' attention and MLP)."""
    names = []
    for bname, block in getattr(model, "layers", {}).items():
        for part in ("attn", "mlp"):
            if part == "mlp" and getattr(block, "moe", False):
                continue
            for pname, mod in getattr(block, part).named_children():
                if pname in PROJECTIONS and hasattr(mod, "weight"):
                    names.append(f"layers.{bname}.{part}.{pname}")
    output = getattr(model, "output", None)
    if output is not None and hasattr(output, "weight") and not model.cfg.tied:
        names.append("output")
    return names


def _unfuse_loss(model: nn.Module, names: list[str]) -> None:
    """A quantized output head is called as a layer: the loss goes through the logits, not the fused chunked kernel
    (which reads the float weight)."""
    if "output" in names and getattr(model, "loss", None) is not None:
        model.loss.fused = False


def quantize_model(model: nn.Module, granularity: str = "row", mode: str = "weight", bits: int = 8) -> list[str]:
    """Replaces every projection of :func:`quantized_names` by :class:`Int8Linear` (in place); returns their names."""
    names = quantized_names(model)
    _unfuse_loss(model, names)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, Int8Linear.from_float(getattr(owner, leaf), granularity, mode, bits))
    return names


def empty_quantized(model: nn.Module, mode: str = "weight") -> list[str]:
    """Like :func:`quantize_model` with empty int8 layers (their values loaded afterwards), on the model's device."""
    names = quantized_names(model)
    _unfuse_loss(model, names)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, leaf)
        setattr(
            owner,
            leaf,
            Int8Linear(old.in_features, old.out_features, old.bias is not None, mode, device=old.weight.device),
        )
    return names


def set_mode(model: nn.Module, mode: str) -> None:
    """Switches every :class:`Int8Linear` of ``model`` to ``mode`` (``weight`` or ``full``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.mode = mode
