"""Principal TEAL — built here (docs/methods.md §12): each token keeps its projection on the top
principal axes of its layer's FFN inputs whole, and TEAL's calibrated thresholds sparsify the rest
and the down input, all inside TEAL's byte budget.

What each anchor does well, and what it costs:

* LaRoSa (§5.11) rotates the FFN input into the principal axes of calibration activations, where
  a token's energy concentrates, and keeps the top k there — but reading the rotation costs d²
  weights per layer per step, an eighth of the dense FFN's reads on SmolLM2.
* TEAL (§5.5) thresholds magnitudes with per-layer thresholds calibrated to the target density;
  a token with more large entries keeps more of them, which measured better than an exact top k
  per token (WINA, §5.9) on this model.

Most of an FFN input's energy lies along a few principal directions (the massive activations of a
few outlier features); the remainder is close to isotropic, where a rotation gains little. So:

    P  = the top r eigenvectors of Σ_t x_t x_tᵀ over calibration tokens      [d, r]  (LaRoSa's Q, cut)
    z  = x P, kept whole;   e = x − z Pᵀ;   keep e_i where |e_i| > t_e[l]
    x̂  = z Pᵀ + S(e);   H = act(x̂ W_g) ⊙ (x̂ W_u);   keep H_j where |H_j| > t_h[l]

A kernel reads P (d·r), the principal part's gate/up columns W P (2·f·r, folded once), the kept
residual columns of gate/up and the kept down columns. The budget is TEAL's reads at sparsity
s = 1 − n_keep/f, the basis included: k_x = round(d(1 − α·s)) input columns of which r are the
principal ones (residual density (k_x − r)/d), and the down input the most entries with
d·r + 2·f·k_x + d·k_h ≤ 3·d·f·(1 − s) (and ≤ WINA's reads: never more bytes than either).
α = 0.9 (the input a little denser than TEAL's, the down input a little sparser) and r = 16
were chosen on the development play (Hamlet) at 20% and 40%. The thresholds are the quantiles of |e| and |H| at those
densities on the calibration corpus (the one calibration pipeline and cache), so — as TEAL's —
they meet the density on average, not exactly per token; the decode aux reports the actual
densities. The prompt runs dense. ``aggregate`` as TEAL's ("per_token" default, "max", "mean").

Its data: ``{"principal_teal": {"basis": [L, d, r], "t_e": [L], "t_h": [L]}}`` ([L · slots, ...]
on a MoE model, one basis and threshold pair per FFN block: `models.moe.table_row`); with a
Pallas ``kernel`` (TPU, GPU) also the folded (W P)ᵀ and TEAL's input-major copies
(`popjax.methods.input_rows`), which that kernel reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..calibration import Statistic, calibrate, log_histogram
from ..loaded import unrolled
from ..models.config import ModelConfig
from ..models.moe import table_row
from .activation_sparsity import DensePrefillPlan, SparsityBudget
from .base import (DensePlan, block_rows, check_choice, MethodError, Plan, activations, down_proj, gate_activation,
                   resolve_corpus)
from .fitted import FittedArrays, array_digest
from .input_rows import float_gate_up, gated, input_rows_data, kernel_down, kernel_gate_up, kernel_weights_read, resolve_kernel
from .larosa import LaRoSa
from .teal import block_quantiles, threshold_keep


def folded_principal(stack, basis: jax.Array) -> jax.Array:
    """(W_gu P)ᵀ per layer [L, r, 2f] from the (dequantized) stacked FFN weights and bases [L, d, r]."""
    return jnp.einsum("lnd,ldr->lrn", float_gate_up(stack), basis)


def principal_split(x: jax.Array, basis: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., d], basis P [d, r] (orthonormal columns) -> (x P Pᵀ, x − x P Pᵀ), in float32."""
    xf = x.astype(jnp.float32)
    principal = jnp.einsum("...r,dr->...d", jnp.einsum("...d,dr->...r", xf, basis), basis)
    return principal, xf - principal


@dataclasses.dataclass(frozen=True, eq=False)
class ResidualHistograms(Statistic):
    """Principal TEAL's calibration statistic: histograms of |e| (the FFN input minus its
    projection on the block's principal basis) and of |H| over valid tokens. ``basis`` [rows, d, r]
    is the calibrated basis (compared by identity; its fingerprint is in the cache key)."""

    name: ClassVar[str] = "principal_residual_histograms"
    version: ClassVar[int] = 1
    basis: Any = None
    blocks: int = 0

    def key(self) -> dict[str, Any]:
        fields = f"basis {list(np.shape(self.basis))} {array_digest(self.basis)}"
        return {"name": self.name, "version": self.version, "fields": fields}

    def collect(self, w, x, valid, h):
        basis = jnp.asarray(self.basis)[table_row(w, self.blocks)]
        _, rest = principal_split(x, basis)
        return {"e": log_histogram(rest, valid), "h": log_histogram(h, valid)}


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class PrincipalFit(FittedArrays):
    """What Principal TEAL calibrates: ``basis`` [rows, d, r], thresholds ``t_e`` and ``t_h``
    [rows] for ``densities`` (residual, down input); ``source``: the model and corpus."""

    source: str
    basis: np.ndarray
    t_e: np.ndarray
    t_h: np.ndarray
    densities: tuple[float, float]
    blocks: int = 0


@dataclasses.dataclass(frozen=True)
class PrincipalTEALPlan(DensePrefillPlan):
    """Principal TEAL's decode (see the module docstring); ``n_keep`` is the down input's
    target kept count, ``k_x`` the input columns read (``rank`` of them principal)."""

    name: ClassVar[str] = "principal-teal"
    rank: int = 16
    k_x: int = 0
    aggregate: str = "per_token"
    blocks: int = 0
    # "xla", or a Pallas kernel reading the kept residual inputs' rows and kept channels' rows of
    # the input-major copies (`input_rows`), the principal part through ``data["folded"]`` (W P)
    kernel: str = "xla"

    def __post_init__(self):
        check_choice("kernel", self.kernel, kernels.RESOLVED)

    def decode(self, w, state, x, step, valid):
        """x [B, 1, d], valid [B, 1] -> (y [B, 1, d], state, actual densities: fp32 scalars)."""
        data, row = w.data["principal_teal"], table_row(w, self.blocks)
        principal, rest = principal_split(x, data["basis"][row])
        keep_e, dens_e = threshold_keep(rest, valid, data["t_e"][row], self.aggregate)
        if self.kernel == "xla":
            x_hat = (principal + jnp.where(keep_e, rest, 0.0)).astype(x.dtype)
            h = activations(w.gate_up, x_hat, gate_activation(w))
        else:  # x̂ W = (x P)(W P)ᵀ + S(e) W: the folded principal columns dense, the kept residual rows by the kernel
            z = jnp.einsum("bxd,dr->bxr", x.astype(jnp.float32), data["basis"][row])
            gu = kernel_gate_up(w, rest.astype(x.dtype), keep_e, f=self.f, expected_active=self.k_x - self.rank, kernel=self.kernel)
            h = gated(w, (jnp.einsum("bxr,rn->bxn", z, data["folded"][row]) + gu).astype(x.dtype), self.f)
        keep_h, dens_h = threshold_keep(h, valid, data["t_h"][row], self.aggregate)
        if self.kernel == "xla":
            y = down_proj(jnp.where(keep_h, h, 0), w.down)
        else:
            y = kernel_down(w, h, keep_h, d=x.shape[-1], expected_active=self.n_keep, kernel=self.kernel)
        return y, state, {"density_x": dens_e, "density_h": dens_h}

    def ffn_weights_read(self, d: int) -> int:
        """At the target densities: the basis, k_x gate/up columns (the rank principal ones as the
        folded W P), n_keep down columns (the TPU kernel reads whole rows:
        `input_rows.kernel_weights_read`)."""
        principal = d * self.rank + 2 * self.f * self.rank
        return principal + kernel_weights_read(self.kernel, d, self.f, self.k_x - self.rank, self.n_keep)

    def ffn_flops_per_token(self, d: int) -> int:
        return 2 * (d * self.rank + self.ffn_weights_read(d))


@dataclasses.dataclass(frozen=True)
class PrincipalTEAL(SparsityBudget):
    """``PrincipalTEAL(ratio=0.2, rank=16, alpha=0.9, aggregate="per_token")`` or
    ``PrincipalTEAL(ffn_sparsity=0.5)``; ``calibrate(model, corpus)`` or ``prepare(model)`` fits
    the bases and thresholds.

    Args:
      ratio / ffn_sparsity: TEAL's budget: the FFN's weight reads at sparsity s, the basis included.
      rank: principal directions kept whole per token, 1 ≤ rank < round(d(1 − alpha·s)).
      alpha: the input's share of the sparsity (input columns read k_x = round(d(1 − alpha·s)),
        as LaRoSa's ``alpha``), in (0, 2]; the down input takes what the budget leaves.
      aggregate: "per_token" (each row its own mask), "max" or "mean" (one mask per batch).
      kernel: "auto" (the Pallas kernel on TPU and GPU, XLA on a CPU), "xla" or "pallas": TEAL's
        kernel on the residual and down input, the principal part through the folded W P.
    """

    name: ClassVar[str] = "principal-teal"
    calibrates: ClassVar[bool] = True
    rank: int = dataclasses.field(default=16, kw_only=True)
    alpha: float = dataclasses.field(default=0.9, kw_only=True)
    fit: PrincipalFit | None = dataclasses.field(default=None, kw_only=True, repr=False)
    kernel: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        check_choice("kernel", self.kernel, kernels.KERNELS)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise MethodError(f"PrincipalTEAL: rank={self.rank!r} is invalid; give an integer ≥ 1 (below the kept input columns)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 < self.alpha <= 2.0:
            raise MethodError(f"PrincipalTEAL: alpha={self.alpha!r} is outside (0, 2]: it is the input's share of the sparsity")
        if self.fit is not None and not isinstance(self.fit, PrincipalFit):
            raise MethodError(f"PrincipalTEAL: fit={self.fit!r} is not a PrincipalFit (use calibrate or prepare)")

    def sizes(self, cfg: ModelConfig) -> tuple[int, int]:
        """(k_x, k_h): input columns read, k_x = round(d(1 − alpha·s)) (``rank`` principal, the
        rest residual), and down-input entries kept at the target: the most with
        d·r + 2·f·k_x + d·k_h at or below both TEAL's reads, round(3·d·f·(1 − s)), and WINA's,
        2·f·round(d(1 − s)) + d·round(f(1 − s)), so that at equal ratio it never reads more than
        either (rounding included)."""
        d, f, s = cfg.hidden_size, cfg.intermediate_size, self.sparsity(cfg)
        k_x = min(round(d * (1.0 - self.alpha * s)), d)
        if self.rank >= k_x:
            raise MethodError(f"PrincipalTEAL: rank={self.rank} must be below the {k_x} input columns this budget reads (d = {d}, "
                              f"sparsity {s:.3f}, alpha {self.alpha})")
        teal = round(3 * d * f * (1.0 - s))
        wina = 2 * f * round(d * (1.0 - s)) + d * round(f * (1.0 - s))
        k_h = (min(teal, wina) - 2 * f * k_x - d * self.rank) // d
        if k_h < 1:
            raise MethodError(f"PrincipalTEAL: alpha={self.alpha} leaves no down-input budget (k_x = {k_x} of {d} input "
                              f"columns at sparsity {s:.3f}): lower alpha")
        return k_x, min(k_h, f)

    def densities(self, cfg: ModelConfig) -> tuple[float, float]:
        """The target densities of the residual and of the down input."""
        k_x, k_h = self.sizes(cfg)
        return (k_x - self.rank) / cfg.hidden_size, k_h / cfg.intermediate_size

    def calibrate(self, model, corpus=None, **calibrate_kwargs: Any) -> "PrincipalTEAL":
        """A copy holding the fitted bases (LaRoSa's rotations, the same cached moments, cut to
        ``rank`` axes) and the thresholds at this budget's densities (cached histograms)."""
        model = unrolled(model)
        corpus = resolve_corpus(model, corpus)
        cfg = model.config
        dens_e, dens_h = self.densities(cfg)
        rotations = LaRoSa(self.ratio, ffn_sparsity=self.ffn_sparsity).calibrate(model, corpus, **calibrate_kwargs).rotations
        basis = np.ascontiguousarray(rotations.q[..., : self.rank], np.float32)
        hist = calibrate(model, ResidualHistograms(basis, rotations.blocks), corpus, **calibrate_kwargs)
        rows = basis.shape[0]  # a MoE block no calibration token reached takes its layer's pooled quantile
        t_e = np.asarray(block_quantiles(np.asarray(hist["e"]), 1.0 - dens_e), np.float32).reshape(rows)
        t_h = np.asarray(block_quantiles(np.asarray(hist["h"]), 1.0 - dens_h), np.float32).reshape(rows)
        for a in (basis, t_e, t_h):
            a.flags.writeable = False
        fit = PrincipalFit(rotations.source, basis, t_e, t_h, (dens_e, dens_h), rotations.blocks)
        return dataclasses.replace(self, fit=fit)

    def prepare(self, model) -> "PrincipalTEAL":
        """Ready for ``model``: itself when fitted for this budget (or dense), else `calibrate`."""
        cfg = model.config
        if self.sparsity(cfg) == 0.0 or (self.fit is not None and self.fit.densities == self.densities(cfg)):
            return self
        return self.calibrate(model)

    def bind(self, cfg: ModelConfig) -> Plan:
        f, d = cfg.intermediate_size, cfg.hidden_size
        if self.sparsity(cfg) == 0.0:
            return DensePlan(f=f, n_keep=f)
        if self.fit is None:
            raise MethodError("PrincipalTEAL is not fitted: use PrincipalTEAL(...).calibrate(model) (or .prepare(model)) first")
        blocks, rows = block_rows(cfg)
        want = (rows, d, self.rank)
        if self.fit.basis.shape != want or self.fit.blocks != blocks or self.fit.densities != self.densities(cfg):
            raise MethodError(f"PrincipalTEAL: {self.fit!r} does not fit this model and budget (basis {want}, densities "
                              f"{self.densities(cfg)}): calibrate on it")
        k_x, k_h = self.sizes(cfg)
        return PrincipalTEALPlan(f=f, n_keep=k_h, rank=self.rank, k_x=k_x, aggregate=self.aggregate, blocks=blocks,
                                 kernel=resolve_kernel("PrincipalTEAL", self.kernel, cfg))

    def data(self, model) -> dict | None:
        """``{"principal_teal": {"basis": [L, d, r], "t_e": [L], "t_h": [L]}}`` float32; None
        when the budget prunes nothing. With a Pallas kernel also ``"folded"`` [L, r, 2f], the
        principal columns of gate/up, (W_gu P)ᵀ from the (dequantized) weights, and ``"rows"``
        (`input_rows.input_rows_data`)."""
        plan = self.bind(model.config)
        if isinstance(plan, DensePlan):
            return None
        fit = self.fit
        data = {"principal_teal": {"basis": jnp.asarray(fit.basis), "t_e": jnp.asarray(fit.t_e), "t_h": jnp.asarray(fit.t_h)}}
        if plan.kernel == "xla":
            return data
        basis = data["principal_teal"]["basis"]  # folded once per model and fit, not at every call
        folded = model.derived(f"principal_teal_folded/{array_digest(fit.basis)}",
                               lambda m: folded_principal(m.ffn_stack(), basis))
        return {"principal_teal": {**data["principal_teal"], "folded": folded}, "rows": input_rows_data(model)}
