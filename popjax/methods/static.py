"""Static ablation (POP paper Table 6, variant 1; ≈ GRIFFIN with POP's metric; docs/methods.md §2).

The top n_keep channels by prefill importance are fixed for the whole generation; their
gate/up rows and down columns are gathered once at prefill (on a mesh: split over "model",
base.copy_channels).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .base import gate_activation, AggregatedPlan, RatioMethod, activations, copy_channels, copy_gate_up, down_proj, score_prompt


@dataclasses.dataclass(frozen=True)
class StaticPlan(AggregatedPlan):
    name: ClassVar[str] = "static"

    def _prefill(self, w, x, valid):
        y, order, importance = score_prompt(w, x, valid, self.n_keep)
        kept = order[: self.n_keep]
        state = {
            "kept_idx": kept,  # [n_keep]
            "gate_up": copy_gate_up(w.gate_up, kept),  # [2, n_keep', d] (n_keep' ≥ n_keep: copy_channels)
            "down": copy_channels(w.down, kept, axis=1),  # [d, n_keep']
        }
        return y, state, {"importance": importance}

    def _decode(self, w, state, x, step, valid):
        return down_proj(activations(state["gate_up"], x, gate_activation(w)), state["down"]), state, {}

    def ffn_flops_per_token(self, d: int) -> int:
        return 6 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 3 * d * self.n_keep


@dataclasses.dataclass(frozen=True)
class Static(RatioMethod):
    """Prefill-fixed structured pruning: the top n_keep channels by prompt importance, kept for
    the whole generation. ``Static(ratio, aggregate="per_sequence" | "shared")``."""

    name: ClassVar[str] = "static"
    plan_class: ClassVar[type] = StaticPlan
