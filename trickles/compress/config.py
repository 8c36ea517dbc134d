"""The ``[distill]`` section: :class:`DistillConfig`, what distillation (:mod:`trickles.compress.distill`) is asked
to do, checked at load time. It imports only the options and errors, so :mod:`trickles.config` reads it without
reaching the distiller and, through it, the trainer that imports :mod:`trickles.config`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError
from ..options import opt


@dataclass
class DistillConfig:
    """Knowledge distillation from a teacher model (the ``[distill]`` section; ``trickles train --teacher``)."""

    teacher: str = opt(
        "",
        "teacher to distil from: a trickles checkpoint (step_* directory or a run's out_dir) or a Hugging Face "
        "directory; empty: no distillation",
    )
    alpha: float = opt(
        0.5, "weight of the soft-target term alpha T^2 KL(teacher || student); the cross-entropy gets 1 - alpha"
    )
    temperature: float = opt(2.0, "softmax temperature T of both models' distributions in the KL term")
    hidden_weight: float = opt(
        0.0, "weight of the MSE between mapped hidden states (0: off); a learned projection bridges different widths"
    )
    layer_map: list[str] = opt(
        [],
        "student:teacher block pairs for the hidden-state loss, e.g. ['0:1', '1:3'] (empty: student block i to teacher "
        "block round((i+1) L_t / L_s) - 1)",
    )

    def validate(self) -> None:
        if self.teacher and not os.path.exists(self.teacher):
            raise ConfigError(
                f"distill.teacher {self.teacher} does not exist; give a trickles checkpoint, a run's out_dir "
                "or a Hugging Face directory"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"distill.alpha must be in [0, 1], got {self.alpha}")
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature must be positive, got {self.temperature}")
        if not self.hidden_weight >= 0:
            raise ConfigError(f"distill.hidden_weight must be 0 or more, got {self.hidden_weight}")
        self.pairs()

    def pairs(self) -> list[tuple[int, int]] | None:
        """The ``layer_map`` as ``(student, teacher)`` block pairs (None: the default map)."""
        if not self.layer_map:
            return None
        out = []
        for item in self.layer_map:
            s, sep, t = str(item).partition(":")
            if not sep or not s.strip().isdigit() or not t.strip().isdigit():
                raise ConfigError(f"distill.layer_map entry {item!r} is not 'student:teacher', e.g. '0:1'")
            out.append((int(s), int(t)))
        return out

    def check_layout(self, dims, zero: int) -> None:
        """ConfigError for the layouts distillation does not support (:mod:`trickles.compress.distill`)."""
        if not self.teacher:
            return
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(dims, name) > 1:
                raise ConfigError(
                    f"distillation (distill.teacher / --teacher) runs under data parallelism only, but "
                    f"parallel.{name}={getattr(dims, name)}; set parallel.{name}=1 and use parallel.dp"
                )
        if zero == 3:
            raise ConfigError("distillation does not run under parallel.zero=3; use parallel.zero=0, 1 or 2")
