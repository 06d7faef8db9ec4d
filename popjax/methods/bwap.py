"""Batch-wise Adaptive Pruning (BWAP; arXiv 2608.14003; docs/methods.md §3).

One channel mask per batch and layer, chosen by periodic top-k on batch-aggregated activation
scores with an activation memory:

    score     per sample b, over its T_b valid tokens: z_t = H_t / ‖H_t‖₂,
              s_b[j] = ‖z[:, j]‖₂ / √T_b          (activations only, no weight norms)
    batch     s̄ = max_b s_b (or mean_b), over samples with at least one valid token
    memory    mem ← max(mem, s̄)                   (no decay; ``memory=False``: mem ← s̄)
    mask      the top k of mem (``lax.top_k``: ties to the lower channel id)

Schedule (a static function of the decode ``step``, evaluated with ``lax.cond`` inside the
compiled loop, so nothing runs in Python per step):

    prefill                   dense output; its score s₀ initialises mem
    steps [0, t_init)         dense exploration; at the end of step t_init − 1: mem, mask
    then cycles of t_prune + t_explore steps:
        t_prune pruned steps  y = W_d[:, K] (silu(W_g[K] x) ⊙ W_u[K] x) on compact blocks
        t_explore dense steps exploration; at the end of the cycle's last step: mem, mask

**Exploration statistic** (state, per sample): ``sumsq [B, f]`` = Σ over the phase's valid
tokens of z_t², and ``count [B]`` = number of those tokens; s_b = √(sumsq / count). Both are
reset at every mask update. Samples with count 0 (stopped or padding rows) take no part in the
aggregation; if none has a token, s̄ = 0 (mem unchanged).

**Compact blocks**: the kept gate/up rows ``[2, k, d]`` and down weights (as rows ``[k, d]``) are
gathered at prefill (from s₀) and at every update (inside the update branch of a ``lax.cond``,
so other steps do no gather); pruned steps read only them. State per layer: ``memory [f]``,
``kept_idx [k]``, ``sumsq [B, f]``, ``count [B]``, ``gate_up [2, k, d]``, ``down_rows [k, d]``.

**Budget**: ``ratio`` is the global ratio of docs/methods.md §1 (k = n_keep); ``ffn_sparsity=ρ`` is the
paper's target sparsity instead (k = ⌊(1 − ρ)·f⌋). ``ffn_weights_read`` is the average over
one cycle, the update's gather included: (t_prune·3dk + t_explore·3df + 3dk) / (t_prune + t_explore);
`pruned_step_weights_read` and `explore_step_weights_read` give the two step kinds.

Ablation: ``schedule="every_step"`` computes H on all channels at every step, updates mem with
that step's score and applies the top k of mem to the same step (no dense exploration).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..models.config import ModelConfig
from .base import (FFNWeights, gate_activation, DensePlan, Method, MethodError, Plan, activations, dot, check_global_ratio, copy_channels, copy_gate_up,
                   down_proj, kept_channels, take_channels)

BATCH_AGGREGATES = ("max", "mean")
SCHEDULES = ("periodic", "every_step")
DEFAULT_RATIO = 0.2


def check_ratio_or_sparsity(method: str, ratio, ffn_sparsity) -> None:
    """Exactly one budget: the global ``ratio`` (docs/methods.md §1) or the paper's ``ffn_sparsity``."""
    if ratio is not None and ffn_sparsity is not None:
        raise MethodError(f"{method}: give ratio={ratio!r} or ffn_sparsity={ffn_sparsity!r}, not both")
    if ratio is not None:
        check_global_ratio(ratio)
    if ffn_sparsity is not None and (
        isinstance(ffn_sparsity, bool) or not isinstance(ffn_sparsity, (int, float)) or not 0.0 <= ffn_sparsity < 1.0
    ):
        raise MethodError(f"{method}: ffn_sparsity={ffn_sparsity!r} is outside [0, 1): the fraction of FFN channels pruned")


def _check_period(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise MethodError(f"BWAP: {name}={value!r} is invalid; use an integer ≥ {minimum} (decode steps)")


def kept_down_rows(w: FFNWeights, kept: jax.Array) -> jax.Array:
    """The kept channels' down weights as rows [k, d]. Rows, not the columns [d, k] of W_d: the
    block is rewritten inside the decode loop, and XLA lays a column gather out transposed,
    which then costs a transposing copy at every pruned step (measured in the compiled HLO).
    On a mesh the block is split over "model" and padded to [k', d] (`copy_channels`)."""
    return copy_channels(w.down, kept, axis=1).T


def sample_sumsq(h: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per sample: Σ over valid tokens of (H_t / ‖H_t‖₂)² and the token count.
    h [B, T, f], valid [B, T] -> ([B, f] fp32, [B] fp32)."""
    hf = h.astype(jnp.float32)
    sq = hf * hf
    norm2 = jnp.sum(sq, axis=-1, keepdims=True)
    z2 = jnp.where(valid[..., None] & (norm2 > 0), sq / jnp.where(norm2 > 0, norm2, 1.0), 0.0)
    return jnp.sum(z2, axis=1), jnp.sum(valid, axis=1).astype(jnp.float32)


def batch_score(sumsq: jax.Array, count: jax.Array, aggregate: str) -> jax.Array:
    """s̄ [f] from the per-sample statistic: s_b = √(sumsq_b / T_b), max or mean over samples
    that have tokens (0 when none has)."""
    has = count > 0
    s = jnp.sqrt(sumsq / jnp.maximum(count, 1.0)[:, None])
    s = jnp.where(has[:, None], s, 0.0)
    if aggregate == "max":
        return jnp.max(s, axis=0)  # scores are ≥ 0, so rows without tokens (0) never win
    return jnp.sum(s, axis=0) / jnp.maximum(jnp.sum(has), 1).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class BWAPPlan(Plan):
    name: ClassVar[str] = "bwap"
    t_init: int = 8
    t_explore: int = 4
    t_prune: int = 16
    aggregate: str = "max"
    memory: bool = True
    schedule: str = "periodic"

    @property
    def period(self) -> int:
        return self.t_prune + self.t_explore

    def phase(self, step) -> tuple[jax.Array, jax.Array]:
        """-> (explore, update): whether step ``step`` runs dense, whether the memory and mask
        are refreshed at its end. Works on traced and concrete steps alike."""
        step = jnp.asarray(step, jnp.int32)
        in_init = step < self.t_init
        pos = jnp.mod(step - self.t_init, self.period)
        explore = in_init | (pos >= self.t_prune)
        update = (step == self.t_init - 1) | (~in_init & (pos == self.period - 1))
        return explore, update

    def _refresh(self, memory, score):
        memory = jnp.maximum(memory, score) if self.memory else score
        kept = jax.lax.top_k(memory, self.n_keep)[1]
        return memory, kept

    def prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (dense y, state, {"score": s₀ [f]})."""
        h = activations(w.gate_up, x, gate_activation(w))
        sumsq, count = sample_sumsq(h, valid)
        s0 = batch_score(sumsq, count, self.aggregate)
        memory, kept = self._refresh(jnp.zeros_like(s0), s0)
        state = {"memory": memory, "kept_idx": kept}
        if self.schedule == "periodic":
            state.update(
                sumsq=jnp.zeros_like(sumsq),  # [B, f] running Σ z² of the current exploration phase
                count=jnp.zeros_like(count),  # [B] its valid tokens
                gate_up=copy_gate_up(w.gate_up, kept),  # [2, k', d] (k' ≥ k on a mesh: copy_channels)
                down_rows=kept_down_rows(w, kept),  # [k', d]
            )
        return down_proj(h, w.down), state, {"score": s0}

    def decode(self, w, state, x, step, valid):
        if self.schedule == "every_step":
            return self._decode_every_step(w, state, x, valid)
        explore, update = self.phase(step)

        def dense(_):
            h = activations(w.gate_up, x, gate_activation(w))
            sumsq, count = sample_sumsq(h, valid)
            return down_proj(h, w.down), state["sumsq"] + sumsq, state["count"] + count

        def pruned(_):
            y = dot("btk,kd->btd", activations(state["gate_up"], x, gate_activation(w)), state["down_rows"])
            return y, state["sumsq"], state["count"]

        y, sumsq, count = jax.lax.cond(explore, dense, pruned, None)
        y = y

        def refresh(_):
            memory, kept = self._refresh(state["memory"], batch_score(sumsq, count, self.aggregate))
            return {
                "memory": memory,
                "kept_idx": kept,
                "sumsq": jnp.zeros_like(sumsq),
                "count": jnp.zeros_like(count),
                "gate_up": copy_gate_up(w.gate_up, kept),
                "down_rows": kept_down_rows(w, kept),
            }

        def keep(_):
            return {**state, "sumsq": sumsq, "count": count}

        state = jax.lax.cond(update, refresh, keep, None)
        density = jnp.where(explore, 1.0, self.n_keep / self.f).astype(jnp.float32)
        aux = {"explore": explore, "update": update, "density": density, "kept_idx": state["kept_idx"]}
        return y, state, aux

    def _decode_every_step(self, w, state, x, valid):
        h = activations(w.gate_up, x, gate_activation(w))
        memory, kept = self._refresh(state["memory"], batch_score(*sample_sumsq(h, valid), self.aggregate))
        y = down_proj(take_channels(h, kept, axis=-1), take_channels(w.down, kept, axis=1))
        density = jnp.float32((2 * self.f + self.n_keep) / (3 * self.f))
        aux = {"explore": jnp.bool_(False), "update": jnp.bool_(True), "density": density, "kept_idx": kept}
        return y, {"memory": memory, "kept_idx": kept}, aux

    # ------------------------------------------------------------ cost accounting

    def pruned_step_weights_read(self, d: int) -> int:
        return 3 * d * self.n_keep

    def explore_step_weights_read(self, d: int) -> int:
        return 3 * d * self.f

    def ffn_weights_read(self, d: int) -> int:
        """Per decode token and layer, averaged over one cycle, the update's gather included."""
        if self.schedule == "every_step":
            return 2 * d * self.f + d * self.n_keep
        total = self.t_prune * self.pruned_step_weights_read(d) + self.t_explore * self.explore_step_weights_read(d)
        return round((total + 3 * d * self.n_keep) / self.period)

    def ffn_flops_per_token(self, d: int) -> int:
        """Matmul FLOPs per decode token and layer, averaged over one cycle."""
        if self.schedule == "every_step":
            return 4 * d * self.f + 2 * d * self.n_keep
        return round((self.t_prune * 6 * d * self.n_keep + self.t_explore * 6 * d * self.f) / self.period)


@dataclasses.dataclass(frozen=True)
class BWAP(Method):
    """Batch-wise Adaptive Pruning: ``BWAP(ratio=0.2, t_init=8, t_explore=4, t_prune=16,
    aggregate="max")`` (see the module docstring).

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), in [0, 1); default 0.2.
      ffn_sparsity: instead of ``ratio``, the fraction ρ of FFN channels pruned (k = ⌊(1−ρ)f⌋).
      t_init: dense exploration steps before the first mask (≥ 1).
      t_explore: dense exploration steps per cycle (≥ 1).
      t_prune: pruned steps per cycle (≥ 0; 0 = always dense).
      aggregate: "max" (the paper) or "mean" over the batch's samples.
      memory: keep the activation memory (False: each update uses only the last phase's score).
      schedule: "periodic" (the paper) or "every_step" (top-k at every step, an ablation).
    """

    name: ClassVar[str] = "bwap"
    aggregates: ClassVar[tuple[str, ...]] = BATCH_AGGREGATES
    ratio: float | None = None
    _: dataclasses.KW_ONLY
    ffn_sparsity: float | None = None
    t_init: int = 8
    t_explore: int = 4
    t_prune: int = 16
    aggregate: str = "max"
    memory: bool = True
    schedule: str = "periodic"

    def __post_init__(self):
        check_ratio_or_sparsity("BWAP", self.ratio, self.ffn_sparsity)
        if self.ratio is None and self.ffn_sparsity is None:
            object.__setattr__(self, "ratio", DEFAULT_RATIO)
        _check_period("t_init", self.t_init, 1)
        _check_period("t_explore", self.t_explore, 1)
        _check_period("t_prune", self.t_prune, 0)
        if self.aggregate not in BATCH_AGGREGATES:
            raise MethodError(f"BWAP: aggregate={self.aggregate!r} is not one of {BATCH_AGGREGATES}")
        if self.schedule not in SCHEDULES:
            raise MethodError(f"BWAP: schedule={self.schedule!r} is not one of {SCHEDULES}")
        if not isinstance(self.memory, bool):
            raise MethodError(f"BWAP: memory={self.memory!r} must be True or False")

    def bind(self, cfg: ModelConfig) -> Plan:
        f = cfg.intermediate_size
        if self.ratio is not None:
            k = kept_channels(cfg, self.ratio)
        else:
            k = int(math.floor((1.0 - self.ffn_sparsity) * f))
            if k < 1:
                raise MethodError(f"BWAP: ffn_sparsity={self.ffn_sparsity} keeps no channel of f={f}; use a smaller value")
        if k == f:
            return DensePlan(f=f, n_keep=f)
        return BWAPPlan(
            f=f, n_keep=k, t_init=self.t_init, t_explore=self.t_explore, t_prune=self.t_prune,
            aggregate=self.aggregate, memory=self.memory, schedule=self.schedule,
        )
