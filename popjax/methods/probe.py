"""Probe Pruning — "Probe Pruning: Accelerating LLMs through Dynamic Pruning via Model-Probing"
(Le, Diao, Wang, Wang, Ding, Yang, Anwar; ICLR 2025, arXiv 2502.15618; docs/methods.md §5), FFN part.

PP prunes batch by batch, in three stages per FFN and per forward pass:

1. **Probe.** A small, important part of the batch is run through gate/up on all f channels.
   With r_bt = ‖x_bt‖₂ the norm of token (b, t)'s MLP input:
   * sequences: the top ``⌈probe_batch · n_seq⌉`` valid sequences by ``sqrt(Σ_t r_bt²)``
     (at least one);
   * tokens: in each of them, the top ``⌈probe_tokens · n_b⌉`` of its n_b valid tokens by r_bt
     (at least one). The probe statistic is the mean squared activation over the probe tokens,
     ``q_j = Σ_{(b,t) ∈ probe} a_btj² / |probe|``.
2. **History-informed pruning** (the paper's importance-scaled fusion). A per-channel history h_j
   of mean squared activations is fused with the probe:
       p_j = q_j / (q_j + h_j + 1e-6),   c_j = (1 − p_j)·h_j + p_j·q_j
   and channels are ranked by PP's structured metric ``S_j = c_j · sqrt(Σ_i W_d[i,j]⁴)``
   (= ‖c_j · W_d[:, j]²‖₂). The top n_keep channels by S are kept: one selection per batch.
3. **Full inference** of the batch on the kept channels. Its activations then update the history
   of the kept channels only (pruned channels were not computed), with the paper's EMA:
       stat_j = Σ_{valid (b,t)} a_btj² / n_valid
       h_j ← stat_j                          the first time channel j is observed
       h_j ← μ·h_j + (1 − μ)·stat_j           afterwards (μ = ``momentum``, paper 0.99)
   A pass with no valid token leaves the history unchanged.

**When selection happens.** The paper runs probe → prune → full inference on every forward pass
of a batch. In generation, the prompt is the first forward pass, and each decode step is one more
(its batch is one token per sequence), so PP re-probes and re-selects at every step, with the
history carrying what earlier passes saw. At a decode step each probed sequence contributes its
single token; with ``aggregate="per_sequence"`` each sequence is its own batch (its own probe,
history and selection).

**Decisions where the paper and this engine differ** (documented in docs too):

* *Probe ranking input.* The paper's default ranks by the pre-norm residual stream ("respick");
  the MLP function here receives ``x = RMSNorm(residual)``, so r_bt is the norm of the normalised
  MLP input: the paper code's variant without "respick". Its variation across tokens comes from
  the norm's per-feature weights only, so the ranking is weaker than the residual's.
* *History.* The paper seeds the history from 2000 calibration samples (C4) and keeps it per
  sequence position. Here it starts empty at each generation's prompt (PP stays calibration-free,
  like POP) and is kept per channel, since a decode step's positions move on every step.
* *Compute.* A decode step needs gate/up on all f channels for the probe; a decode step is bound
  by reading weights, and computing those channels for the other rows of the step reads the same
  weights, so all rows reuse them and only the down projection is restricted to the kept
  channels. A step therefore reads ``2·d·f + d·n_keep`` FFN weights and does
  ``4·d·f + 2·d·n_keep`` FLOPs per token (probe included), like the dynamic ablation. The prompt
  is handled the same way: outputs are identical to computing only the kept channels.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import (gate_activation, 
    AggregatedPlan,
    MethodError,
    RatioMethod,
    activations,
    down_proj,
    masked_down,
    rank_channels,
    take_channels,
)

FUSION_EPS = 1e-6  # the paper's guard in p_j = q_j / (q_j + h_j + eps)
COUNT_EPS = 1e-6  # keeps ⌈frac·n⌉ exact when frac·n is an integer up to float rounding


def fraction_count(frac: float, n: jax.Array) -> jax.Array:
    """max(1, ⌈frac · n⌉) for an int count n (a traced scalar or array) -> int32."""
    return jnp.maximum(1, jnp.ceil(frac * n.astype(jnp.float32) - COUNT_EPS)).astype(jnp.int32)


def ranks(scores: jax.Array) -> jax.Array:
    """Rank of each entry along the last axis (0 = largest; ties: the lower index first)."""
    order = jax.lax.top_k(scores, scores.shape[-1])[1]
    return jnp.argsort(order, axis=-1).astype(jnp.int32)  # the inverse permutation


def probe_mask(x: jax.Array, valid: jax.Array, probe_batch: float, probe_tokens: float) -> jax.Array:
    """The probe: x [B, T, d], valid [B, T] -> [B, T] bool (see the module docstring, stage 1)."""
    r2 = jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1)  # r_bt² [B, T]
    seq_valid = jnp.any(valid, axis=1)
    seq_score = jnp.where(seq_valid, jnp.sqrt(jnp.sum(jnp.where(valid, r2, 0.0), axis=1)), -jnp.inf)
    n_seq = fraction_count(probe_batch, jnp.sum(seq_valid))
    seq_sel = seq_valid & (ranks(seq_score) < n_seq)  # [B]
    n_tok = fraction_count(probe_tokens, jnp.sum(valid, axis=1))  # [B]
    tok_rank = ranks(jnp.where(valid, r2, -jnp.inf))  # [B, T]
    return seq_sel[:, None] & valid & (tok_rank < n_tok[:, None])


def mean_square(h: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-channel mean of a² over the masked tokens: h [B, T, n], mask [B, T] -> ([n] fp32, count)."""
    hf = jnp.where(mask[..., None], h.astype(jnp.float32), 0.0)
    count = jnp.sum(mask)
    return jnp.sum(hf * hf, axis=(0, 1)) / jnp.maximum(count, 1), count


def fuse(probe_stat: jax.Array, history: jax.Array) -> jax.Array:
    """Importance-scaled fusion c_j = (1 − p_j)·h_j + p_j·q_j, p_j = q_j/(q_j + h_j + eps)."""
    p = probe_stat / (probe_stat + history + FUSION_EPS)
    return (1.0 - p) * history + p * probe_stat


def update_history(state: dict, h_kept: jax.Array, kept: jax.Array, valid: jax.Array, momentum: float) -> dict:
    """EMA update of the kept channels' history from the full-inference activations h_kept [B, T, n_keep]."""
    stat, count = mean_square(h_kept, valid)
    old = take_channels(state["history"], kept, axis=0)
    seen = take_channels(state["seen"], kept, axis=0)
    new = jnp.where(seen, momentum * old + (1.0 - momentum) * stat, stat)
    new = jnp.where(count > 0, new, old)  # nothing observed: keep the history
    return {
        **state,
        "history": state["history"].at[kept].set(new),
        "seen": state["seen"].at[kept].set(seen | (count > 0)),
    }


@dataclasses.dataclass(frozen=True)
class ProbePruningPlan(AggregatedPlan):
    name: ClassVar[str] = "probe"
    probe_batch: float = 0.05
    probe_tokens: float = 0.5
    momentum: float = 0.99

    def _select(self, h, x, valid, state):
        """Stages 1–2: -> (kept [n_keep] int32, scores S [f], probe mask [B, T])."""
        probe = probe_mask(x, valid, self.probe_batch, self.probe_tokens)
        q, _ = mean_square(h, probe)
        scores = fuse(q, state["history"]) * state["down_l4"]
        return rank_channels(scores)[: self.n_keep], scores, probe

    def _prefill(self, w, x, valid):
        """x [B, T, d] -> (y [B, T, d], {"history", "seen": [f], "down_l4": [f]}, aux)."""
        down = w.down.astype(jnp.float32)
        f = down.shape[1]
        state = {
            "history": jnp.zeros((f,), jnp.float32),
            "seen": jnp.zeros((f,), bool),
            # sqrt(Σ_i W_d[i,j]⁴): computed once here so decode steps never read all of W_d
            "down_l4": jnp.sqrt(jnp.sum(down**4, axis=0)),
        }
        h = activations(w.gate_up, x, gate_activation(w))  # [B, T, f]
        kept, scores, probe = self._select(h, x, valid, state)
        y = masked_down(h, kept, w.down)
        state = update_history(state, take_channels(h, kept, axis=-1), kept, valid, self.momentum)
        return y, state, {"importance": scores, "probe": probe}

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], updated history, {"selected": [n_keep], "scores": [f]})."""
        h = activations(w.gate_up, x, gate_activation(w))  # [B, 1, f]: the probe's rows and the others in one pass
        kept, scores, probe = self._select(h, x, valid, state)
        h_kept = take_channels(h, kept, axis=-1)
        y = down_proj(h_kept, take_channels(w.down, kept, axis=1))
        state = update_history(state, h_kept, kept, valid, self.momentum)
        return y, state, {"selected": kept, "scores": scores}

    def ffn_flops_per_token(self, d: int) -> int:
        return 4 * d * self.f + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 2 * d * self.f + d * self.n_keep

    def ffn_weights_read_per_step(self, d: int, batch: int) -> int:
        """Shared gate/up once; per-sequence mode gathers each row's own down columns."""
        rows = batch if self.aggregate == "per_sequence" else 1
        return 2 * d * self.f + rows * d * self.n_keep


def _check_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0.0 < value <= 1.0):
        raise MethodError(f"{name}={value!r} is outside (0, 1]: it is the fraction of the batch that forms the probe")


@dataclasses.dataclass(frozen=True)
class ProbePruning(RatioMethod):
    """Probe Pruning: ``ProbePruning(ratio=0.2, probe_batch=0.05, probe_tokens=0.5, momentum=0.99)``.

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), all from the FFN.
      probe_batch: fraction of the valid sequences probed per forward pass, in (0, 1] (at least one;
        paper default 5%).
      probe_tokens: fraction of each probed sequence's valid tokens, in (0, 1] (paper default 50%).
      momentum: EMA momentum μ of the history, in [0, 1] (paper 0.99).
      aggregate: "per_sequence" (default: each sequence its own probe, history and selection) or
        "shared" (the paper's batch setting: one probe, history and selection per batch).
    """

    name: ClassVar[str] = "probe"
    plan_class: ClassVar[type] = ProbePruningPlan
    probe_batch: float = dataclasses.field(default=0.05, kw_only=True)
    probe_tokens: float = dataclasses.field(default=0.5, kw_only=True)
    momentum: float = dataclasses.field(default=0.99, kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        _check_fraction("probe_batch", self.probe_batch)
        _check_fraction("probe_tokens", self.probe_tokens)
        if isinstance(self.momentum, bool) or not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum <= 1.0):
            raise MethodError(f"momentum={self.momentum!r} is outside [0, 1]: it is the EMA weight of the history")

    def plan_sizes(self, f: int, n_keep: int) -> dict:
        return {"probe_batch": float(self.probe_batch), "probe_tokens": float(self.probe_tokens), "momentum": float(self.momentum)}
