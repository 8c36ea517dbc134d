"""The feed-forward layer of a dense block, and of a mixture-of-experts block's shared experts
(:class:`~trickles.models.moe.MoE`): llama's gated SiLU (or, with ``model.mlp_activation=gelu_tanh``, GeGLU) or
gpt2's GELU (tanh) MLP."""

from __future__ import annotations

from torch import nn

from ..kernels.activations import geglu, geglu_packed, gelu_tanh, swiglu, swiglu_packed
from .config import ModelConfig


class Activation(nn.Module):
    """The MLP's nonlinearity as a module of its own (no parameters): ``swiglu(gate, up)``, ``swiglu_packed(gate_up)``,
    their GeGLU siblings ``geglu``, ``geglu_packed``, or ``gelu_tanh(up)``, so that recomputation
    (:mod:`trickles.memory.recompute`) can find its output and rerun it."""

    FUNCTIONS = {
        "swiglu": swiglu,
        "swiglu_packed": swiglu_packed,
        "geglu": geglu,
        "geglu_packed": geglu_packed,
        "gelu_tanh": gelu_tanh,
    }

    def __init__(self, kind: str, kernels: str):
        super().__init__()
        self.kind, self.kernels = kind, kernels
        self.fn = self.FUNCTIONS[kind]

    def forward(self, *pre):
        return self.fn(*pre, self.kernels)


class MLP(nn.Module):
    """llama: ``down(silu(gate(x)) * up(x))`` (``gelu_tanh`` for silu with ``model.mlp_activation``); gpt2:
    ``down(gelu_tanh(up(x)))``; every projection with a bias where ``cfg.bias("mlp")`` (gpt2 always).

    With ``model.fused_proj`` the dense llama MLP computes gate and up in one ``gate_up_proj: d -> 2f`` (rows
    interleaved channel by channel, :mod:`trickles.models.fused`); ``hidden`` given (a mixture-of-experts
    block's shared experts) keeps them apart.
    """

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        bias = cfg.bias("mlp")
        self.gated = cfg.flavor == "llama"
        self.fused = self.gated and hidden is None and cfg.fuses_projections
        hidden = hidden or cfg.ffn_dim
        if self.fused:
            self.gate_up_proj = nn.Linear(cfg.d_model, 2 * hidden, bias=bias)
        else:
            if self.gated:
                self.gate_proj = nn.Linear(cfg.d_model, hidden, bias=bias)
            self.up_proj = nn.Linear(cfg.d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        gate = "geglu" if cfg.mlp_activation == "gelu_tanh" else "swiglu"
        self.act = Activation(f"{gate}_packed" if self.fused else gate if self.gated else "gelu_tanh", cfg.kernels)

    def forward(self, x):
        if self.fused:
            h = self.act(self.gate_up_proj(x))
        elif self.gated:
            h = self.act(self.gate_proj(x), self.up_proj(x))
        else:
            h = self.act(self.up_proj(x))
        return self.resid_drop(self.down_proj(h))
