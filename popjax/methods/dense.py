"""Dense: no pruning. Its plan, ``DensePlan``, lives in base.py: every method binds to it when
its ratio keeps all channels."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..models.config import ModelConfig
from .base import DensePlan, Method, Plan


@dataclasses.dataclass(frozen=True)
class Dense(Method):
    """The unpruned model."""

    name: ClassVar[str] = "dense"

    @property
    def batch_independent(self) -> bool:
        return True

    def bind(self, cfg: ModelConfig) -> Plan:
        return DensePlan(f=cfg.intermediate_size, n_keep=cfg.intermediate_size)
