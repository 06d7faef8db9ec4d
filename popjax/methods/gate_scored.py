"""Gate-scored POP: POP's prefill partition, candidates scored from the gate projection alone
(issue 15; docs/frontier_methods.md §1).

POP (SPEC §2) computes gate AND up for every candidate at every decode step only to score them,
then keeps m of the 2m. Here a step reads the candidates' gate rows only, scores

    s_c(t) = ‖silu(x_t W_g[c]ᵀ)‖₂ · ‖W_d[:, c]‖₂      (‖·‖₂ over the batch's valid rows)

takes ``S_t = top_m(s)`` with ``lax.top_k`` inside the band, and computes the up projection and
the down projection for the m selected channels only:

    y_t = H_t[R] W_d[:, R]ᵀ + (silu(x_t W_g[S_t]ᵀ) ⊙ x_t W_u[S_t]ᵀ) W_d[:, S_t]ᵀ

Sizes are POP's (``m = min(round(γ·f/2), f − n_keep, n_keep)``, ``n_R = n_keep − m``,
``n_C = 2m``). Weights read per decode token per layer: 3·d per retained channel, d per candidate
(its gate row) and 2·d per selected one (its up row and down column): ``3d·n_R + d·n_C + 2d·m``
against POP's ``3d·n_R + 2d·n_C + d·m``, so the same budget affords twice POP's band
(``m' = 2m``: γ' = 2γ). With γ covering every channel (n_R = n_P = 0, possible when
n_keep = f/2 and γ = 1) it is dynamic selection by the gate score.

The prompt's own output is POP's (top n_keep channels by prompt importance). The compact blocks
are gathered once at prefill: one ``[2n_R + n_C, d]`` block (gate and up rows of R, gate rows of
C) for one dense matmul per step and R's down columns, both split over ``model`` on a mesh
(base.copy_rows / copy_channels, R padded with zero channels to a multiple of the split), and the
candidates' up rows and down columns as row blocks ``[n_C, d]`` from which a step gathers its m
selected rows (replicated, as POP's candidate down rows).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..sharding import pad_ids
from .base import MethodError, copy_channels, copy_rows, down_proj, prefill_importance, score_prompt, take_channels
from .pop import POP, POPPlan


def check_global_partition(method: POP) -> None:
    """The methods built on POP's partition implement the global one only (POP's
    ``partition="per_shard"`` would otherwise bind silently to plain sharded POP)."""
    partition = getattr(method, "partition", "global")
    if partition != "global":
        raise MethodError(f"{method.name}: partition={partition!r} is not supported; only 'global'")


def gate_scores(g: jax.Array, valid: jax.Array, down_norm: jax.Array) -> jax.Array:
    """s_c = ‖silu(g[valid, c])‖₂ · ‖W_d[:, c]‖₂: g (gate pre-activations) [B, 1, n], valid
    [B, 1], down_norm [n] -> [n] fp32."""
    return prefill_importance(jax.nn.silu(g), valid, down_norm)


@dataclasses.dataclass(frozen=True)
class GateScoredPlan(POPPlan):
    name: ClassVar[str] = "pop-gate"

    def _prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (y [B, T, d], partition state, {"importance": [f]})."""
        y, order, importance = score_prompt(w, x, valid, self.n_keep)
        n_r, n_c = self.n_retained, self.n_candidates
        retained, candidates = order[:n_r], order[n_r : n_r + n_c]
        f = w["gate_up"].shape[1]
        padded = pad_ids(retained)  # n_R' ≥ n_R: a multiple of the mesh's split (zero channels)
        up_padded = jnp.where(padded >= 0, f + padded, -1)  # up row c of gate_up read as [2f, d] is f + c
        state = {
            "retained_idx": retained,  # [n_R]
            "candidate_idx": candidates,  # [n_C]
            # gate R', up R', gate C: [(2 n_R' + n_C)', d]
            "step_rows": copy_rows(w["gate_up"], jnp.concatenate([padded, up_padded, candidates])),
            "up_candidates": take_channels(w["gate_up"][1], candidates, axis=0),  # [n_C, d]
            "down_retained": copy_channels(w["down"], padded, axis=1),  # [d, n_R']
            "down_candidates": take_channels(w["down"], candidates, axis=1).T,  # [n_C, d]
            "down_norm_candidates": take_channels(w["down_norm"], candidates, axis=0),  # [n_C]
        }
        return y, state, {"importance": importance}

    def _step_rows(self, state, x):
        """The step's one dot over ``step_rows``: x [B, 1, d] -> (H of R' [B, 1, n_R'], the gate
        pre-activations of C [B, 1, n_C]); n_R' = n_R without a mesh (see _prefill)."""
        n_r = state["down_retained"].shape[-1]
        z = jnp.einsum("bsd,nd->bsn", x, state["step_rows"])  # [B, 1, (2 n_R' + n_C)']
        return jax.nn.silu(z[..., :n_r]) * z[..., n_r : 2 * n_r], z[..., 2 * n_r : 2 * n_r + self.n_candidates]

    def _decode(self, w, state, x, step, valid):
        """x [B, 1, d] -> (y [B, 1, d], state (unchanged), {"selected", "scores": [m]})."""
        h_retained, g = self._step_rows(state, x)  # g: gate pre-activations of the candidates
        y = down_proj(h_retained, state["down_retained"])
        if self.m == 0:
            return y, state, {}
        scores = gate_scores(g, valid, state["down_norm_candidates"])
        top_scores, selected = jax.lax.top_k(scores, self.m)  # positions within C
        up = jnp.einsum("bsd,md->bsm", x, take_channels(state["up_candidates"], selected, axis=0))
        h_selected = jax.nn.silu(take_channels(g, selected, axis=-1)) * up  # [B, 1, m]
        y = y + h_selected @ take_channels(state["down_candidates"], selected, axis=0)
        aux = {"selected": take_channels(state["candidate_idx"], selected, axis=0), "scores": top_scores}
        return y, state, aux

    def ffn_flops_per_token(self, d: int) -> int:
        """Multiply-adds: gate/up of R, gate of C, up of the m selected, down of n_keep."""
        return 2 * d * (2 * self.n_retained + self.n_candidates + self.m) + 2 * d * self.n_keep

    def ffn_weights_read(self, d: int) -> int:
        return 3 * d * self.n_retained + d * self.n_candidates + 2 * d * self.m


@dataclasses.dataclass(frozen=True)
class GateScoredPOP(POP):
    """POP with candidates scored from the gate alone: ``GateScoredPOP(ratio=0.2, gamma=0.2,
    aggregate="shared" | "per_sequence")``.

    Args:
      ratio: global fraction of decoder parameters removed (SPEC §1), all from the FFN.
      gamma: candidate band width as a fraction of f, in [0, 1] (POP's sizes). A candidate costs
        half of POP's per step, so γ = 2·γ_POP reads the same bytes as POP at γ_POP.
      aggregate: "shared" (one partition and selection per batch) or "per_sequence".
    """

    name: ClassVar[str] = "pop-gate"
    plan_class: ClassVar[type] = GateScoredPlan

    def __post_init__(self):
        super().__post_init__()
        check_global_partition(self)
