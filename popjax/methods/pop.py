"""POP — Partition-guided Online Pruning (arXiv 2602.06822; SPEC §2).

Prefill ranks every FFN channel by ``I_j = ‖H[S, j]‖₂ · ‖W_d[:, j]‖₂`` over the prompt and splits
the channels into

    R  retained   the top n_R = n_keep − m           always used
    C  candidate  the next n_C = 2m (straddling the cut)  m of them chosen per decode step
    P  pruned     the rest                          never used again

with ``m = min(round(γ·f/2), f − n_keep, n_keep)``. The prompt's own output uses the top
``n_keep`` channels. At decode step t only R ∪ C enter gate/up; the step scores the candidates
by ``|H_t[c]| · ‖W_d[:, c]‖₂``, takes ``S_t = top_m`` with ``lax.top_k`` and computes
``y_t = H_t[R] W_d[R] + H_t[S_t] W_d[S_t]`` — exactly n_keep channels.

Speed: the gate/up columns of R ∪ C and the down rows of R and of C are gathered once at
prefill into the partition state (on a mesh split over "model", base.copy_channels); a decode
step runs dense matmuls on those compact blocks and gathers only the m selected down rows.
``weights="gather"`` skips that copy (the state holds channel ids only) and gathers the rows
from the model's weights at every step instead.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..sharding import constrain, pad_ids
from .base import (
    IN_BOUNDS,
    TAKE_MODE,
    AggregatedPlan,
    DensePlan,
    MethodError,
    RatioMethod,
    activations,
    check_gamma,
    copy_channels,
    copy_gate_up,
    down_proj,
    kept_channels,
    prefill_importance,
    round_half_up,
    score_prompt,
    step_importance,
    take_channels,
    take_gate_up,
)

PARTITIONS = ("global", "per_shard")
WEIGHT_MODES = ("compact", "gather")  # where decode reads the partition's weight rows from


@dataclasses.dataclass(frozen=True)
class POPPlan(AggregatedPlan):
    name: ClassVar[str] = "pop"
    m: int = 0  # candidates selected per step
    gather: bool = False  # weights="gather": no compact copy, per-step gathers (see POP)

    @property
    def n_retained(self) -> int:
        return self.n_keep - self.m

    @property
    def n_candidates(self) -> int:
        return 2 * self.m

    @property
    def compact_weights(self) -> bool:  # see AggregatedPlan; "gather" keeps indices only
        return not self.gather

    def _prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (y [B, T, d], partition state, {"importance": [f]})."""
        y, order, importance = score_prompt(w, x, valid, self.n_keep)
        n_r, n_c = self.n_retained, self.n_candidates
        state = {
            "retained_idx": order[:n_r],  # [n_R]
            "candidate_idx": order[n_r : n_r + n_c],  # [n_C]
            "down_norm_candidates": take_channels(w["down_norm"], order[n_r : n_r + n_c], axis=0),  # [n_C]
        }
        if not self.gather:
            state.update(self._blocks(w, state["retained_idx"], state["candidate_idx"]))
        return y, state, {"importance": importance}

    @staticmethod
    def _blocks(w, retained, candidates):
        """The compact weight blocks of a partition: gate/up rows of R ∪ C [2, (n_R' + n_C)', d],
        down columns of R [d, n_R'] and down rows of C [n_C, d] (rows, so that a step gathers
        its m selected channels contiguously). On a mesh the first two are split over "model"
        (`copy_channels`; R and then R ∪ C padded with zero channels to a multiple of the
        split: n_R' ≥ n_R); C's down rows, which every step gathers from, stay replicated."""
        retained = pad_ids(retained)
        return {
            "gate_up": copy_gate_up(w["gate_up"], jnp.concatenate([retained, candidates])),
            "down_retained": copy_channels(w["down"], retained, axis=1),
            "down_candidates": take_channels(w["down"], candidates, axis=1).T,
        }

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], state (unchanged), {"selected", "scores": [m]}).
        With ``gather`` the R ∪ C gate/up rows and R's down columns are gathered from the
        model's weights here, every step, instead of read from a copy made at prefill."""
        if self.gather:
            gate_up = take_gate_up(w["gate_up"], jnp.concatenate([state["retained_idx"], state["candidate_idx"]]))
        else:
            gate_up = state["gate_up"]
        h = activations(gate_up, x)  # [B, 1, (n_R' + n_C)']
        down_retained = take_channels(w["down"], state["retained_idx"], axis=1) if self.gather else state["down_retained"]
        n_r = down_retained.shape[-1]  # n_R' (padded on a mesh, see _blocks)
        h_retained, h_candidates = h[..., :n_r], h[..., n_r : n_r + self.n_candidates]
        y = down_proj(h_retained, down_retained)
        if self.m == 0:
            return y, state, {}
        scores = step_importance(h_candidates, valid, state["down_norm_candidates"])  # [n_C]
        top_scores, selected = jax.lax.top_k(scores, self.m)  # S_t, positions within C
        selected_ids = take_channels(state["candidate_idx"], selected, axis=0)
        if self.gather:  # only the m selected down columns, as rows [m, d]
            down_selected = take_channels(w["down"], selected_ids, axis=1).T
        else:
            down_selected = take_channels(state["down_candidates"], selected, axis=0)
        y = y + take_channels(h_candidates, selected, axis=-1) @ down_selected
        return y, state, {"selected": selected_ids, "scores": top_scores}

    def ffn_flops_per_token(self, d: int) -> int:
        return 4 * d * (self.n_retained + self.n_candidates) + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 2 * d * (self.n_retained + self.n_candidates) + d * self.n_keep


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
        h = activations(w["gate_up"], x)  # [B, T, f]
        importance = prefill_importance(h, valid, w["down_norm"])  # [f]
        order = jax.lax.top_k(importance.reshape(S, block), block)[1]  # [S, block] ids within each block
        rows = jnp.arange(S)[:, None]
        kept = jnp.zeros((S, block), h.dtype).at[rows, order[:, :keep]].set(1, mode=IN_BOUNDS)
        y = down_proj(h * kept.reshape(-1), w["down"])
        offset = rows * block
        state = {
            "retained_idx": order[:, :n_r] + offset,
            "candidate_idx": order[:, n_r : n_r + n_c] + offset,
            "down_norm_candidates": jnp.take_along_axis(
                w["down_norm"].reshape(S, block), order[:, n_r : n_r + n_c], axis=1, mode=TAKE_MODE
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
        gate_up = w["gate_up"].reshape(2, self.shards, self.block, -1)  # gate/up × block × channel
        return jnp.take_along_axis(gate_up, live[None, :, :, None], axis=2, mode=TAKE_MODE)

    def _down_rows(self, w, live):
        """Down columns of channels ``live`` [S, n], as rows [S, n, d] (a step gathers contiguously)."""
        down = jnp.take_along_axis(w["down"].reshape(-1, self.shards, self.block), live[None], axis=2, mode=TAKE_MODE)
        return jnp.transpose(down, (1, 2, 0))

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
        gu = jnp.einsum("btd,gskd->btgsk", x, gate_up)
        h = jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]  # [B, 1, S, n_R + n_C]
        h_retained, h_candidates = h[..., : self.n_retained], h[..., self.n_retained :]
        y = jnp.einsum("btsk,skd->btd", h_retained, down_retained)
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
            down_selected = jnp.take_along_axis(state["down_candidates"], selected[:, :, None], axis=1, mode=TAKE_MODE)
        y = y + jnp.einsum("btsm,smd->btd", h_selected, down_selected)
        return y, state, {"selected": selected_ids, "scores": top_scores}

    def ffn_flops_per_token(self, d: int) -> int:
        return self.shards * (4 * d * (self.n_retained + self.n_candidates)) + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return self.shards * 2 * d * (self.n_retained + self.n_candidates) + d * self.n_keep


@dataclasses.dataclass(frozen=True)
class POP(RatioMethod):
    """Partition-guided Online Pruning: ``POP(ratio=0.2, gamma=0.1, aggregate="shared")``.

    Args:
      ratio: global fraction of decoder parameters removed, in [0, 1); all of it comes from the
        FFN (SPEC §1), attention is never pruned.
      gamma: width of the candidate band as a fraction of f, in [0, 1] (paper default 0.1).
      aggregate: "shared" (the paper: one partition and one selection per batch) or
        "per_sequence" (each sequence its own; results independent of batch composition).
      partition: "global" (one ranking over all f channels; under tensor parallelism only scores
        travel) or "per_shard" (the channels split into ``shards`` blocks, each ranking its own
        and keeping n_keep/shards of them; see POPShardedPlan and docs/sharding.md).
      shards: blocks of "per_shard" (must divide f); default: the size of the model's mesh
        "model" axis, or 1 (= a global ranking) for an unsharded model.
      weights: "compact" (default: prefill copies the R ∪ C gate/up rows and down columns into
        the state, so decode runs dense matmuls on contiguous blocks) or "gather" (the state
        keeps only channel ids; every decode step gathers those rows from the model's weights).
        Same outputs; "gather" saves the copy — (3·n_R + 4·m)·d elements per layer, per sequence
        with aggregate="per_sequence" — for per-step gathers (docs/scale_out.md).
    """

    name: ClassVar[str] = "pop"
    plan_class: ClassVar[type] = POPPlan
    gamma: float = dataclasses.field(default=0.1, kw_only=True)
    partition: str = dataclasses.field(default="global", kw_only=True)
    shards: int | None = dataclasses.field(default=None, kw_only=True)
    weights: str = dataclasses.field(default="compact", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_gamma(self.gamma)
        if self.partition not in PARTITIONS:
            raise MethodError(f"partition={self.partition!r} is not one of {PARTITIONS}")
        if self.shards is not None and (isinstance(self.shards, bool) or not isinstance(self.shards, int) or self.shards < 1):
            raise MethodError(f"shards={self.shards!r} is invalid; use a positive integer that divides f")
        if self.partition == "per_shard" and self.plan_class is not POPPlan:
            raise MethodError(f"{self.name}: partition='per_shard' is implemented for 'pop' only")
        if self.shards is not None and self.partition != "per_shard":
            raise MethodError(f"shards={self.shards} applies to partition='per_shard' only (partition={self.partition!r})")
        if self.weights not in WEIGHT_MODES:
            raise MethodError(f"weights={self.weights!r} is not one of {WEIGHT_MODES}")
        if self.weights == "gather" and self.plan_class is not POPPlan:
            raise MethodError(f"{self.name}: weights='gather' is implemented for 'pop' only")

    def prepare(self, model) -> "POP":
        """per_shard without ``shards`` takes the model mesh's "model" axis size."""
        mesh = getattr(model, "mesh", None)
        if self.partition == "per_shard" and self.shards is None and mesh is not None:
            return dataclasses.replace(self, shards=dict(mesh.shape).get("model", 1))
        return self

    def bind(self, cfg):
        if self.partition == "global":
            return super().bind(cfg)
        f, n_keep, shards = cfg.intermediate_size, kept_channels(cfg, self.ratio), self.shards or 1
        if f % shards:
            raise MethodError(f"shards={shards} does not divide the FFN width f={f}")
        block = f // shards
        keep = min(block, max(1, round_half_up(n_keep / shards)))
        if n_keep == f or keep == block:
            return DensePlan(f=f, n_keep=f)
        m = min(round_half_up(self.gamma * block / 2), block - keep, keep)
        return POPShardedPlan(f=f, n_keep=keep * shards, aggregate=self.aggregate, shards=shards, m=m,
                              gather=self.weights == "gather")

    def plan_sizes(self, f: int, n_keep: int) -> dict[str, int]:
        sizes = {"m": min(round_half_up(self.gamma * f / 2), f - n_keep, n_keep)}
        return sizes | ({"gather": True} if self.weights == "gather" else {})
