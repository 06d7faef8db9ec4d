"""What the per-token activation-sparsity methods share (TEAL, CATS, WINA, LaRoSa, principal
TEAL; docs/methods.md §5.5–§5.11, §12): the budget (a global ``ratio`` or the paper's
``ffn_sparsity``), the batch rule (``aggregate``: per-token masks or one from the batch's
`batch_scores`), an exact per-token top k (`top_k_mask`) and the dense prefill of their plans.

These methods sparsify the MLP's inputs at every decode step and leave the prompt dense; a plan
reads its calibrated data from ``w.data``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..models.config import ModelConfig
from .base import Method, MethodError, Plan, activations, down_proj, gate_activation, kept_channels
from .bwap import DEFAULT_RATIO, check_ratio_or_sparsity

THRESHOLD_AGGREGATES = ("max", "mean", "per_token")


def check_threshold_aggregate(method: str, aggregate: str) -> None:
    if aggregate not in THRESHOLD_AGGREGATES:
        raise MethodError(f"{method}: aggregate={aggregate!r} is not one of {THRESHOLD_AGGREGATES}")


def batch_scores(a: jax.Array, valid: jax.Array, aggregate: str) -> jax.Array:
    """One score per entry from the batch's valid rows, for a mask every row shares: the max
    ("max") or the mean ("mean") of a [B, 1, n] (non-negative) over the valid rows -> [n]."""
    masked = jnp.where(valid[..., None], a, 0.0)
    if aggregate == "max":
        return jnp.max(masked, axis=(0, 1))
    return jnp.sum(masked, axis=(0, 1)) / jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)


def top_k_mask(scores: jax.Array, valid: jax.Array, k: int, aggregate: str) -> jax.Array:
    """Which entries of scores [B, 1, n] (non-negative) a step keeps: the top ``k`` of each row
    ("per_token"), or of the rows' `batch_scores`, shared by every row -> bool, broadcastable to
    scores. Ties: the lower index first."""
    if aggregate == "per_token":
        _, idx = jax.lax.top_k(scores, k)  # [B, 1, k]
        b = jnp.arange(scores.shape[0])[:, None, None]
        t = jnp.arange(scores.shape[1])[None, :, None]
        return jnp.zeros(scores.shape, bool).at[b, t, idx].set(True)
    agg = batch_scores(scores, valid, aggregate)
    _, idx = jax.lax.top_k(agg, k)
    return jnp.zeros(agg.shape, bool).at[idx].set(True)


@dataclasses.dataclass(frozen=True)
class SparsityBudget(Method):
    """A method whose budget is an FFN sparsity s: given as the global ``ratio`` (s = 1 −
    n_keep/f, the weights a structured method keeping n_keep channels reads) or directly as
    ``ffn_sparsity``; ``aggregate`` is the batch rule (per token, or one mask from the batch's
    max / mean)."""

    aggregates: ClassVar[tuple[str, ...]] = THRESHOLD_AGGREGATES
    ratio: float | None = None
    _: dataclasses.KW_ONLY
    ffn_sparsity: float | None = None
    aggregate: str = "per_token"

    def __post_init__(self):
        name = type(self).__name__
        check_ratio_or_sparsity(name, self.ratio, self.ffn_sparsity)
        if self.ratio is None and self.ffn_sparsity is None:
            object.__setattr__(self, "ratio", DEFAULT_RATIO)
        check_threshold_aggregate(name, self.aggregate)

    def sparsity(self, cfg: ModelConfig) -> float:
        """The FFN sparsity s of this budget on ``cfg``."""
        if self.ratio is None:
            return float(self.ffn_sparsity)
        return 1.0 - kept_channels(cfg, self.ratio) / cfg.intermediate_size


@dataclasses.dataclass(frozen=True)
class DensePrefillPlan(Plan):
    """A plan whose prompt runs the full FFN (plus a FLAP checkpoint's down bias) and whose decode
    reads the method's calibrated data."""

    @property
    def requires_data(self) -> bool:
        return True

    def prefill(self, w, x, valid):
        """x [B, T, d] -> (dense y [B, T, d], no state, no aux)."""
        return down_proj(activations(w.gate_up, x, gate_activation(w)), w.down), None, {}
