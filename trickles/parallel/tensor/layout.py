"""The terms the tensor-parallel cost formulas are written in: a group's :class:`Layout` and a block's linears.

:mod:`trickles.parallel.tensor.costs` (bytes sent, parameters held) and
:mod:`trickles.parallel.tensor.activation_costs` (activations saved) are pure functions of a
:class:`~trickles.models.config.ModelConfig` and a :class:`Layout`: the mode (``1d``, ``2d``, ``2.5d``, ``3d``), ``tp``
ranks, and for a grid its side ``q`` and depth (:class:`~trickles.topology.TPGrid`). A grid rank holds ``n`` of the
micro-batch's ``N = B T`` tokens (:meth:`Layout.tokens`): ``N/q`` (2-D), ``N/(q d)`` (2.5-D), ``N/q^2`` (3-D).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...models.config import ModelConfig
from ...topology import TPGrid


@dataclass(frozen=True)
class Layout:
    """A tensor-parallel group's shape: ``mode`` (1d, 2d, 2.5d, 3d) over ``tp`` ranks; a grid's ``q`` and depth."""

    mode: str = "1d"
    tp: int = 1
    q: int = 1
    depth: int = 1
    sequence_parallel: bool = False  # 1-D only

    @classmethod
    def of(cls, mode: str, tp: int, depth: int = 1, sequence_parallel: bool = False) -> Layout:
        """The layout of ``tp`` ranks in ``mode`` (ConfigError, naming the nearest valid ``tp``, where there is
        none)."""
        if mode == "1d" or tp == 1:
            return cls("1d", tp, 1, 1, sequence_parallel and tp > 1)
        g = TPGrid.of(mode, tp, depth)
        return cls(g.mode, tp, g.q, g.depth)

    @property
    def grid(self) -> bool:
        return self.mode != "1d"

    @property
    def parts(self) -> int:
        """Sample blocks of a micro-batch (each rank holds whole sequences of one)."""
        return 1 if not self.grid else self.q * self.q if self.mode == "3d" else self.q * self.depth

    @property
    def token_groups(self) -> list[int]:
        """Sizes of the groups over which a rank's feature blocks (norms, biases, positions) are held alike."""
        return {"2d": [self.q], "2.5d": [self.q, self.depth], "3d": [self.q, self.q]}[self.mode]

    def tokens(self, batch: int, seq: int) -> int:
        """``n``: tokens of the residual stream this rank holds."""
        return batch * seq // self.parts


#: a dense block's linear -> the projections (``ModelConfig.bias``'s part) whose bias setting it follows
BIAS_PART = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "qkv_proj": "qkv",
    "o_proj": "o",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}
#: the linears 1-D tensor parallelism splits by input features (their bias whole on every rank)
ROW_PARALLEL = ("o_proj", "down_proj")


def has_bias(cfg: ModelConfig, name: str) -> bool:
    """Whether a dense block's linear ``name`` (``q_proj`` ... ``down_proj``, fused ``qkv_proj``, ``gate_up_proj``)
    has a bias: ``cfg.bias`` of its part (``model.qkv_bias``, ``o_bias``, ``mlp_bias``; unset, the flavor's)."""
    return cfg.bias(BIAS_PART[name])


def block_linears(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """``(name, in, out, bias)`` of a dense block's linears, in the order they run; ``bias``: :func:`has_bias`."""
    d, hd = cfg.d_model, cfg.head_dim
    a, kv, f = cfg.n_heads * hd, cfg.kv_heads * hd, cfg.ffn_dim
    if cfg.fuses_projections:
        attn = [("qkv_proj", d, a + 2 * kv)]
    else:
        attn = [("q_proj", d, a), ("k_proj", d, kv), ("v_proj", d, kv)]
    if cfg.flavor == "llama":
        mlp = [("gate_up_proj", d, 2 * f)] if cfg.fuses_projections else [("gate_proj", d, f), ("up_proj", d, f)]
    else:
        mlp = [("up_proj", d, f)]
    return [
        (name, h, h2, has_bias(cfg, name)) for name, h, h2 in attn + [("o_proj", a, d)] + mlp + [("down_proj", f, d)]
    ]


def bias_elements(cfg: ModelConfig, names: tuple[str, ...] | None = None) -> int:
    """Bias elements of one dense block (of its linears ``names`` only, where given)."""
    return sum(h2 for name, _, h2, b in block_linears(cfg) if b and (names is None or name in names))


def block_norms(cfg: ModelConfig) -> int:
    """``d``-wide norms of one block: two before attention and MLP (``model.norm_placement`` pre, sandwich), two on
    their outputs (post, sandwich)."""
    return 2 * (cfg.norm_placement in ("pre", "sandwich")) + 2 * (cfg.norm_placement in ("post", "sandwich"))


def qk_norm_elements(cfg: ModelConfig, tp: int = 1) -> tuple[int, int]:
    """``(held, partial)``: q/k norm weight elements one 1-D tensor-parallel rank holds per block, and those of them
    whose gradient is summed over ``tp`` (``model.qk_norm``): per head ``[h]`` each, replicated, its gradient from the
    rank's heads (partial at ``tp > 1``); full width ``[a h]`` and ``[a_kv h]``, split with the heads."""
    hd = cfg.head_dim
    if cfg.qk_norm == "head":
        return 2 * hd, 2 * hd if tp > 1 else 0
    if cfg.qk_norm == "full":
        return (cfg.n_heads + cfg.kv_heads) * hd // tp, 0
    return 0, 0
