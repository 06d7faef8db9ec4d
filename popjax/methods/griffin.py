"""GRIFFIN — prompt-prompted structured FFN pruning ("Prompt-prompted Adaptive Structured Pruning
for Efficient LLM Generation", Dong, Chen and Chi, COLM 2024; docs/methods.md §5).

GRIFFIN observes "flocking": within one sequence, the FFN channels that are active are nearly the
same from token to token. It therefore scores channels once, on the prompt, with a token-normalised
activation metric and keeps the top channels for the whole generation:

    z_t = a_t / ‖a_t‖₂          a_t = H[t, :], the input of W_d for token t    [f]
    s_j = ‖z[:, j]‖₂            over the valid prompt tokens                    [f]
    kept = top n_keep of s      (ties: the lower channel id first)

Unlike POP's metric there is no weight norm, and every token has the same total weight (its row is
unit-norm), so a few tokens with large activations cannot dominate the selection.

Decisions where the paper is silent or differs from docs/methods.md §2's static variant:

* **The prompt runs dense.** As in the paper, the prompt phase uses the full FFN; the selection
  only affects generated tokens (static.py, by contrast, applies the pruning structure to the
  prompt's output too, as docs/methods.md §2 prescribes for POP and its ablations).
* **Batches.** ``aggregate="shared"``: one selection per batch, s_j over every valid token of every
  sequence. ``aggregate="per_sequence"`` (the paper's setting, batch of one): a selection per
  sequence. A token whose activation row is all zeros contributes nothing (z_t = 0).
* **Decode** is the static decode: the kept gate/up rows and down columns are gathered once at
  prefill into compact blocks, so a step reads only the kept channels (3·d·n_keep weights).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .base import gate_activation, RatioMethod, activations, copy_channels, copy_gate_up, down_proj, rank_channels
from .static import StaticPlan


def griffin_scores(h: jax.Array, valid: jax.Array) -> jax.Array:
    """s_j = ‖z[:, j]‖₂ with z_t = a_t/‖a_t‖₂ over the valid tokens: h [B, T, f], valid [B, T] -> [f] fp32."""
    hf = h.astype(jnp.float32)
    norms = jnp.sqrt(jnp.sum(hf * hf, axis=-1, keepdims=True))  # [B, T, 1]
    use = valid[..., None] & (norms > 0)  # an all-zero row has no direction; it adds nothing
    z = jnp.where(use, hf / jnp.where(norms > 0, norms, 1.0), 0.0)
    return jnp.sqrt(jnp.sum(z * z, axis=(0, 1)))


@dataclasses.dataclass(frozen=True)
class GRIFFINPlan(StaticPlan):
    """GRIFFIN's prefill (dense output, token-normalised prompt scores); StaticPlan's decode."""

    name: ClassVar[str] = "griffin"

    def _prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (dense y [B, T, d], compact kept blocks, {"importance": [f]})."""
        h = activations(w.gate_up, x, gate_activation(w))  # [B, T, f]
        scores = griffin_scores(h, valid)
        kept = rank_channels(scores)[: self.n_keep]
        state = {
            "kept_idx": kept,  # [n_keep]
            "gate_up": copy_gate_up(w.gate_up, kept),  # [2, n_keep', d] (n_keep' ≥ n_keep: copy_channels)
            "down": copy_channels(w.down, kept, axis=1),  # [d, n_keep']
        }
        return down_proj(h, w.down), state, {"importance": scores}


@dataclasses.dataclass(frozen=True)
class GRIFFIN(RatioMethod):
    """GRIFFIN: ``GRIFFIN(ratio=0.2, aggregate="per_sequence" | "shared")``.

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), all from the FFN.
      aggregate: "per_sequence" (default; the paper's per-prompt selection) or "shared" (one
        selection from every valid token of the batch).
    """

    name: ClassVar[str] = "griffin"
    plan_class: ClassVar[type] = GRIFFINPlan
