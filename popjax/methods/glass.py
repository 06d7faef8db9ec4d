"""GLASS — global-local aggregation for inference-time sparsification (arXiv 2508.14302;
docs/methods.md §5.10).

GRIFFIN picks a prompt's FFN channels from the prompt alone, which is weakest when the prompt is
short and the generation long. GLASS ranks every channel twice — by the prompt's activations
(local) and by the model's activations over a calibration corpus (global) — and keeps the
channels whose weighted rank is best, fixed for the whole generation:

    local_j  = ‖z[:, j]‖₂ over the prompt's valid tokens, z_t = a_t / ‖a_t‖₂    (GRIFFIN's score)
    global_j = (Σ_t z_tj² over the calibration tokens)^½                       (the same, offline)
    R_j      = λ · rank_local(j) + (1 − λ) · rank_global(j)     rank 0 = the highest score
    kept     = the n_keep channels of smallest R (ties: the lower channel id first)

where a_t = H[t, :] is the input of W_d. ``score="impact"`` (the paper's I-GLASS) multiplies
both scores by ‖W_d[:, j]‖₂ before ranking; ``score="activation"`` is A-GLASS.

Decisions (docs/methods.md §5.10 gives the reasons; the paper's formulas were not reachable in
full here):

* **Weighted Borda** aggregation of the two rank vectors with one λ for every layer (the
  paper's "weighted rank aggregation"); λ = 1 is GRIFFIN, λ = 0 a fixed, prompt-free selection;
  λ in steps of 1/1024, so equal aggregated ranks tie exactly (`LAM_STEPS`).
* **The global statistic** is GRIFFIN's score accumulated over popjax's default calibration
  corpus (Shakespeare, without the development and held-out plays), through the one
  calibration pipeline and cache; the paper prefers text the model generated itself.
* **The prompt runs dense** and decode reads compact copies of the kept channels (GRIFFIN's
  and the static plan's decode: 3·d·n_keep weights per step).
* **Batches** (``aggregate``): "shared" (one selection from every valid prompt token of the
  batch) or "per_sequence" (one per prompt, the paper's setting).
* **Mixture-of-experts models**: a global prior per FFN block (every routed expert, every
  shared or dense block), from the calibration tokens routed to it.

The global prior reaches the compiled steps as the method's data, ``{"glass": {"prior":
[L, f]}}`` ([L · slots, f] on a MoE model: `models.moe.table_row`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..calibration import Statistic, calibrate
from ..loaded import unrolled
from ..models.config import ModelConfig
from ..models.moe import table_row
from .base import DensePlan, block_rows, MethodError, Plan, RatioMethod, activations, copy_channels, copy_gate_up, down_proj, gate_activation, rank_channels, resolve_corpus
from .fitted import FittedArrays
from .griffin import griffin_scores
from .static import StaticPlan

SCORES = ("activation", "impact")


@dataclasses.dataclass(frozen=True)
class NormalizedSquares(Statistic):
    """GLASS's global statistic: Σ_t z_tj² over the valid calibration tokens, z_t = a_t/‖a_t‖₂
    (a token whose activation row is all zeros adds nothing) -> {"sumsq": [f]}."""

    name: ClassVar[str] = "glass_normalized_squares"
    version: ClassVar[int] = 1

    def collect(self, w, x, valid, h):
        hf = h.astype(jnp.float32)
        norms = jnp.sqrt(jnp.sum(hf * hf, axis=-1, keepdims=True))
        use = valid[..., None] & (norms > 0)
        z = jnp.where(use, hf / jnp.where(norms > 0, norms, 1.0), 0.0)
        return {"sumsq": jnp.sum(z * z, axis=(0, 1))}


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class GlobalPrior(FittedArrays):
    """The global scores of every FFN block: ``scores`` [L, f] (a MoE model: [L · slots, f]);
    ``source``: the model and calibration corpus."""

    source: str
    scores: np.ndarray
    blocks: int = 0


# λ is applied in integer steps of 1/LAM_STEPS, so the aggregated ranks are exact integers and
# equal ones tie exactly (then the lower channel id wins), not by float rounding
LAM_STEPS = 1024


def channel_ranks(scores: jax.Array) -> jax.Array:
    """Each channel's position when ranked by decreasing score (0 = highest; ties: the lower
    channel id ranks first): [f] -> [f] int32."""
    order = rank_channels(scores)
    return jnp.zeros(scores.shape, jnp.int32).at[order].set(jnp.arange(scores.shape[-1], dtype=jnp.int32))


def aggregated_ranks(local: jax.Array, prior: jax.Array, lam: float) -> jax.Array:
    """R_j = λ·rank_local(j) + (1 − λ)·rank_global(j), times LAM_STEPS, as exact integers:
    [f], [f] -> [f] int32 (smaller is better)."""
    w_local = round(lam * LAM_STEPS)
    return w_local * channel_ranks(local) + (LAM_STEPS - w_local) * channel_ranks(prior)


@dataclasses.dataclass(frozen=True)
class GLASSPlan(StaticPlan):
    """GLASS's prefill (dense output, the aggregated ranking); the static plan's decode."""

    name: ClassVar[str] = "glass"
    lam: float = 0.5
    score: str = "activation"
    blocks: int = 0  # block slots per layer of a MoE model, 0: dense

    @property
    def requires_data(self) -> bool:
        return True

    def _prefill(self, w, x, valid):
        """x [B, T, d], valid [B, T] -> (dense y [B, T, d], compact kept blocks, {"importance": [f]})."""
        h = activations(w.gate_up, x, gate_activation(w))  # [B, T, f]
        local = griffin_scores(h, valid)
        prior = w.data["glass"]["prior"][table_row(w, self.blocks)]  # [f]
        if self.score == "impact":
            local, prior = local * w.down_norm, prior * w.down_norm
        aggregated = aggregated_ranks(local, prior, self.lam)  # smaller is better
        kept = rank_channels(-aggregated)[: self.n_keep]
        state = {
            "kept_idx": kept,  # [n_keep]
            "gate_up": copy_gate_up(w.gate_up, kept),  # [2, n_keep', d]
            "down": copy_channels(w.down, kept, axis=1),  # [d, n_keep']
        }
        return down_proj(h, w.down), state, {"importance": -aggregated.astype(jnp.float32)}


@dataclasses.dataclass(frozen=True)
class GLASS(RatioMethod):
    """``GLASS(ratio=0.2, lam=0.5, score="activation" | "impact", aggregate="shared" |
    "per_sequence")``; ``calibrate(model, corpus)`` or ``prepare(model)`` gathers the global
    prior (see the module docstring).

    Args:
      ratio: global fraction of decoder parameters removed (docs/methods.md §1), all from the FFN.
      lam: weight of the prompt's (local) ranking, in [0, 1]; 1 − lam weighs the global one.
      score: "activation" (A-GLASS) or "impact" (I-GLASS: scores × ‖W_d[:, j]‖₂).
      aggregate: "shared" or "per_sequence" (one selection per prompt).
    """

    name: ClassVar[str] = "glass"
    calibrates: ClassVar[bool] = True
    plan_class: ClassVar[type] = GLASSPlan
    lam: float = dataclasses.field(default=0.5, kw_only=True)
    score: str = dataclasses.field(default="activation", kw_only=True)
    prior: GlobalPrior | None = dataclasses.field(default=None, kw_only=True, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.lam, bool) or not isinstance(self.lam, (int, float)) or not 0.0 <= self.lam <= 1.0:
            raise MethodError(f"GLASS: lam={self.lam!r} is outside [0, 1]: it weighs the prompt's ranking against the global one")
        if self.score not in SCORES:
            raise MethodError(f"GLASS: score={self.score!r} is not one of {SCORES}")
        if self.prior is not None and not isinstance(self.prior, GlobalPrior):
            raise MethodError(f"GLASS: prior={self.prior!r} is not a GlobalPrior (use calibrate or prepare)")

    def calibrate(self, model, corpus=None, **calibrate_kwargs: Any) -> "GLASS":
        """A copy holding the global prior of ``model`` over ``corpus`` (a `Corpus`, a UTF-8 text
        file, or None: the default Shakespeare corpus), cached by `popjax.calibration.calibrate`."""
        model = unrolled(model)
        corpus = resolve_corpus(model, corpus)
        sums = calibrate(model, NormalizedSquares(), corpus, **calibrate_kwargs)["sumsq"]  # [L, f] or [L, slots, f]
        scores = np.sqrt(np.asarray(sums, np.float64)).astype(np.float32).reshape(-1, sums.shape[-1])
        scores.flags.writeable = False
        blocks, _ = block_rows(model.config)
        return dataclasses.replace(self, prior=GlobalPrior(f"{model.source} / {corpus.name} ({corpus.n_tokens} tokens)", scores, blocks))

    def prepare(self, model) -> "GLASS":
        """Ready for ``model``: itself when it holds a prior (or prunes nothing), else `calibrate`."""
        if self.prior is not None or isinstance(super().bind(model.config), DensePlan):
            return self
        return self.calibrate(model)

    def bind(self, cfg: ModelConfig) -> Plan:
        plan = super().bind(cfg)
        if isinstance(plan, DensePlan):
            return plan
        if self.prior is None:
            raise MethodError("GLASS has no global prior: use GLASS(...).calibrate(model) (or .prepare(model)) first")
        blocks, rows = block_rows(cfg)
        want = (rows, cfg.intermediate_size)
        if self.prior.scores.shape != want or self.prior.blocks != blocks:
            raise MethodError(f"GLASS: {self.prior!r} does not fit this model ((layers{' × block slots' if blocks else ''}, f) = {want}): calibrate on it")
        return dataclasses.replace(plan, lam=float(self.lam), score=self.score, blocks=blocks)

    def data(self, model) -> dict | None:
        """``{"glass": {"prior": [L, f] float32}}`` ([L · slots, f] on a MoE model); None when
        the ratio prunes nothing."""
        if not isinstance(self.bind(model.config), GLASSPlan):
            return None
        return {"glass": {"prior": jnp.asarray(self.prior.scores)}}
