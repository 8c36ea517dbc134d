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


def _bias(cfg: ModelConfig) -> bool:
    return cfg.flavor == "gpt2"


def block_linears(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """``(name, in, out, bias)`` of a dense block's linears, in the order they run."""
    d, hd, b = cfg.d_model, cfg.head_dim, _bias(cfg)
    a, kv, f = cfg.n_heads * hd, cfg.kv_heads * hd, cfg.ffn_dim
    if cfg.fuses_projections:
        attn = [("qkv_proj", d, a + 2 * kv, b)]
    else:
        attn = [("q_proj", d, a, b), ("k_proj", d, kv, b), ("v_proj", d, kv, b)]
    if cfg.flavor == "llama":
        mlp = (
            [("gate_up_proj", d, 2 * f, False)]
            if cfg.fuses_projections
            else [("gate_proj", d, f, False), ("up_proj", d, f, False)]
        )
    else:
        mlp = [("up_proj", d, f, b)]
    return attn + [("o_proj", a, d, b)] + mlp + [("down_proj", f, d, b)]
