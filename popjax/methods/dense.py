"""Dense: no pruning. Every method binds to this plan when its ratio keeps all channels."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..models.config import ModelConfig
from .base import Method, Plan, activations


@dataclasses.dataclass(frozen=True)
class DensePlan(Plan):
    name: ClassVar[str] = "dense"

    def prefill(self, w, x, valid):
        """x [B, T, d] -> (y [B, T, d], no state, no aux)."""
        return activations(w["gate"], w["up"], x) @ w["down"], None, {}

    def decode(self, w, state, x, step):
        return activations(w["gate"], w["up"], x) @ w["down"], state, {}

    def ffn_flops_per_token(self, d: int) -> int:
        return 6 * d * self.f


@dataclasses.dataclass(frozen=True)
class Dense(Method):
    """The unpruned model."""

    name: ClassVar[str] = "dense"

    def bind(self, cfg: ModelConfig) -> Plan:
        return DensePlan(f=cfg.intermediate_size, n_keep=cfg.intermediate_size)
