"""POP with a per-shard partition (docs/methods.md §2, ``partition="per_shard"``; docs/sharding.md).

The f channels form ``shards`` contiguous blocks of f/shards (on a mesh: the channel blocks the
devices hold), and every block runs POP (§2) on its own channels with its share of the budget.
Every ranking and gather acts on a ``[shards, f/shards]`` view of the channel axis, so under
tensor parallelism nothing but activations travels between devices. This is POP's exact scorer
over a partition of another shape, so it is a plan of its own, not a band rule of `POPPlan`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ...kernels.int8 import take_along_axis
from ...sharding import constrain
from ..base import gate_activation, IN_BOUNDS, TAKE_MODE, AggregatedPlan, activations, dot, down_proj, prefill_importance


@dataclasses.dataclass(frozen=True)
class POPShardedPlan(AggregatedPlan):
    """POP with ``partition="per_shard"``: the f channels form ``shards`` contiguous blocks of
    ``f/shards`` (on a mesh: the channel blocks the devices hold), and every block runs POP on
    its own channels with its share of the budget — ``keep`` = n_keep/shards channels, m
    candidates chosen per step among its own 2m. All sizes here are per shard; ``n_keep`` is
    the total (shards·keep, within shards/2 of the global n_keep because of rounding).

    Every ranking and every gather acts on a ``[shards, f/shards]`` view of the channel axis
    (``lax.top_k`` along the block, ``take_along_axis`` within the block), so a block never reads
    another block's weights or scores: under tensor parallelism nothing but activations travels.
    State: ``retained_idx [S, n_R]``, ``candidate_idx [S, n_C]`` (global channel ids),
    ``gate_up [2, S, n_R + n_C, d]``, ``down_retained [S, n_R, d]``, ``down_candidates [S, n_C, d]``,
    ``down_norm_candidates [S, n_C]``."""

    name: ClassVar[str] = "pop"
    shards: int = 1
    m: int = 0  # candidates selected per step, per shard
    gather: bool = False  # weights="gather" (see POP)

    @property
    def compact_weights(self) -> bool:  # see AggregatedPlan; "gather" keeps indices only
        return not self.gather

    @property
    def block(self) -> int:
        return self.f // self.shards

    @property
    def n_retained(self) -> int:  # per shard
        return self.n_keep // self.shards - self.m

    @property
    def n_candidates(self) -> int:  # per shard
        return 2 * self.m

    def _prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (y [B, T, d], partition state, {"importance": [f]})."""
        S, block, keep = self.shards, self.block, self.n_keep // self.shards
        n_r, n_c = self.n_retained, self.n_candidates
        h = activations(w.gate_up, x, gate_activation(w))  # [B, T, f]
        importance = prefill_importance(h, valid, w.down_norm)  # [f]
        order = jax.lax.top_k(importance.reshape(S, block), block)[1]  # [S, block] ids within each block
        rows = jnp.arange(S)[:, None]
        kept = jnp.zeros((S, block), h.dtype).at[rows, order[:, :keep]].set(1, mode=IN_BOUNDS)
        y = down_proj(h * kept.reshape(-1), w.down)
        offset = rows * block
        state = {
            "retained_idx": order[:, :n_r] + offset,
            "candidate_idx": order[:, n_r : n_r + n_c] + offset,
            "down_norm_candidates": jnp.take_along_axis(
                w.down_norm.reshape(S, block), order[:, n_r : n_r + n_c], axis=1, mode=TAKE_MODE
            ),
        }
        if not self.gather:
            state.update(self._blocks(w, order[:, : n_r + n_c]))
        # on a mesh, shard s's compact blocks live on the devices of shard s (moved there once, at
        # prefill), so decode reads 1/S of them per device instead of a replicated copy
        state = {k: constrain(v, ("mlp_shard",) + (None,) * (v.ndim - 1) if k != "gate_up" else (None, "mlp_shard", None, None))
                 for k, v in state.items()}
        return y, state, {"importance": importance}

    def _gate_up_rows(self, w, live):
        """Gate/up rows of channels ``live`` [S, n] (ids within each shard's block) -> [2, S, n, d];
        each shard gathers from its own block only (take_along_axis on the [S, f/S] view)."""
        gate_up = w.gate_up.reshape(2, self.shards, self.block, -1)  # gate/up × block × channel
        return take_along_axis(gate_up, live[None, :, :, None], axis=2, mode=TAKE_MODE)

    def _down_rows(self, w, live):
        """Down columns of channels ``live`` [S, n], as rows [S, n, d] (a step gathers contiguously)."""
        down = take_along_axis(w.down.reshape(-1, self.shards, self.block), live[None], axis=2, mode=TAKE_MODE)
        return down.transpose(1, 2, 0)

    def _blocks(self, w, live):
        """The compact blocks of channels ``live`` [S, n_R + n_C]: gate_up [2, S, n, d],
        down_retained [S, n_R, d], down_candidates [S, n_C, d]."""
        down = self._down_rows(w, live)
        return {"gate_up": self._gate_up_rows(w, live), "down_retained": down[:, : self.n_retained], "down_candidates": down[:, self.n_retained :]}

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], state (unchanged), {"selected", "scores": [S, m]}).
        With ``gather`` the rows are gathered from the model's weights here, every step (only
        the m selected of C's down rows)."""
        local = lambda ids: ids % self.block  # global channel ids -> ids within the shard's block
        if self.gather:
            live = jnp.concatenate([state["retained_idx"], state["candidate_idx"]], axis=1)
            gate_up, down_retained = self._gate_up_rows(w, local(live)), self._down_rows(w, local(state["retained_idx"]))
        else:
            gate_up, down_retained = state["gate_up"], state["down_retained"]
        gu = dot("btd,gskd->btgsk", x, gate_up)
        h = gate_activation(w)(gu[:, :, 0]) * gu[:, :, 1]  # [B, 1, S, n_R + n_C]
        h_retained, h_candidates = h[..., : self.n_retained], h[..., self.n_retained :]
        y = dot("btsk,skd->btd", h_retained, down_retained)
        if self.m == 0:
            return y, state, {}
        hf = jnp.where(valid[..., None, None], h_candidates.astype(jnp.float32), 0.0)
        scores = jnp.sqrt(jnp.sum(hf * hf, axis=(0, 1))) * state["down_norm_candidates"]  # [S, n_C]
        top_scores, selected = jax.lax.top_k(scores, self.m)  # S_t per block, positions within its C
        h_selected = jnp.take_along_axis(h_candidates, selected[None, None], axis=-1, mode=TAKE_MODE)
        selected_ids = jnp.take_along_axis(state["candidate_idx"], selected, axis=1, mode=TAKE_MODE)
        if self.gather:
            down_selected = self._down_rows(w, local(selected_ids))
        else:
            down_selected = take_along_axis(state["down_candidates"], selected[:, :, None], axis=1, mode=TAKE_MODE)
        y = y + dot("btsm,smd->btd", h_selected, down_selected)
        return y, state, {"selected": selected_ids, "scores": top_scores}

    def ffn_flops_per_token(self, d: int) -> int:
        return self.shards * (4 * d * (self.n_retained + self.n_candidates)) + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return self.shards * 2 * d * (self.n_retained + self.n_candidates) + d * self.n_keep
