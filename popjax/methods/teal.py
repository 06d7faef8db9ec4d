"""TEAL — training-free magnitude activation sparsity (arXiv 2408.14690; docs/methods.md §5.5), and the
threshold machinery it shares with CATS.

Per layer l two thresholds, calibrated offline on dense activations so that
``P(|v| < t) = s`` on the calibration corpus:

    x  (the MLP input, i.e. the gate/up input)   t_x[l]: zero x_i where |x_i| ≤ t_x
    H  (the down input)                          t_h[l]: zero H_j where |H_j| ≤ t_h

A sparse kernel then skips the gate/up columns of the zeroed x_i and the down columns of the
zeroed H_j. Here the zeros are applied as masks before dense matmuls (XLA has no sparse GEMV),
so there is no speed claim; ``ffn_weights_read`` reports what such a kernel would read at the
TARGET sparsity, and the decode aux reports the ACTUAL densities of each step and layer.

**Budget** (``ratio`` → sparsity): TEAL's uniform sparsity on both tensors is
``s = 1 − n_keep/f``, so the expected weights read, ``d·f·(2(1 − s) + (1 − s)) = 3·d·n_keep``,
equal those of a structured method keeping n_keep channels. ``ffn_sparsity=s`` gives the
paper's sparsity directly.

**Batches** (``aggregate``): "max" (default) and "mean" are the batched rule of the BWAP paper —
aggregate |·| over the batch's valid rows, then threshold, one mask per batch (at batch 1 this
is TEAL's own per-token rule); "per_token" gives every row its own mask.

**Prefill is dense**: TEAL's generation kernels act on decode only (its accuracy code's partial
prompt sparsification is an evaluation device); BWAP treats the prompt as dense too.

**Mixture-of-experts models** (docs/moe.md): thresholds are per FFN block, ``t[l][slot]``,
from the histograms of the calibration tokens routed to that expert (all tokens for a shared or
dense-layer block); a block no calibration token reached takes the threshold of its layer's
blocks pooled. At run time each block uses its own (``w.block``).

**Thresholds are data, not plan fields**: ``calibrate`` gives a hashable `Thresholds` (what the
cache stores); ``data(model)`` turns it into float32 arrays that the engine passes into its
compiled programs beside the weights (``w.data``), so a new calibration compiles nothing and
no threshold table is baked into the program. The plans hold only the static budget and rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .. import kernels
from ..loaded import unrolled
from ..calibration import Statistic, calibrate, histogram_quantile, log_histogram
from ..models.config import ModelConfig
from .base import gate_activation, DensePlan, MethodError, Plan, activations, check_choice, dot, down_proj, resolve_corpus
from .input_rows import input_rows_data, kernel_activations, kernel_down, kernel_weights_read, resolve_kernel
from .activation_sparsity import THRESHOLD_AGGREGATES, DensePrefillPlan, SparsityBudget, batch_scores, check_threshold_aggregate  # noqa: F401 (re-exported)



@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Per-layer thresholds of a calibrated threshold method: what ``calibrate`` produces and the
    calibration cache stores (`thresholds_data` turns them into the arrays the plans read).

    ``per_tensor`` = ((tensor name, (t_0, ..., t_{L−1})), ...) (a MoE model's t_l is a tuple over
    block slots, see the module docstring); ``sparsity`` = (tensor name,
    target) pairs they were calibrated for; ``source`` names the model and corpus."""

    sparsity: tuple[tuple[str, float], ...]
    per_tensor: tuple[tuple[str, tuple], ...]
    source: str = ""

    def get(self, tensor: str) -> tuple[float, ...]:
        return dict(self.per_tensor)[tensor]


@dataclasses.dataclass(frozen=True)
class AbsHistograms(Statistic):
    """The calibration statistic of TEAL and CATS (one pass serves both): histograms of |x|
    (MLP input), |H| (down input) and |silu(W_g x)| per layer, over valid tokens."""

    name: ClassVar[str] = "mlp_abs_histograms"
    version: ClassVar[int] = 1

    def collect(self, w, x, valid, h):
        gate = gate_activation(w)(dot("btd,nd->btn", x, w.gate_up[0]))
        return {"x": log_histogram(x, valid), "h": log_histogram(h, valid), "gate": log_histogram(gate, valid)}


def calibrate_thresholds(model, targets: dict[str, tuple[str, float]], corpus=None, **calibrate_kwargs) -> Thresholds:
    """targets = {tensor name: (histogram name, sparsity)} -> per-layer quantile thresholds.
    ``corpus``: a `Corpus`, a UTF-8 text file path, or None (the default Shakespeare corpus)."""
    corpus = resolve_corpus(model, corpus)
    hist = calibrate(model, AbsHistograms(), corpus, **calibrate_kwargs)
    per_tensor = tuple((tensor, block_quantiles(np.asarray(hist[stat]), s)) for tensor, (stat, s) in targets.items())
    sparsity = tuple((tensor, s) for tensor, (_, s) in targets.items())
    return Thresholds(sparsity, per_tensor, f"{model.source} / {corpus.name} ({corpus.n_tokens} tokens)")


def block_quantiles(counts: np.ndarray, s: float) -> tuple:
    """Quantile thresholds from histograms: [L, bins] -> (t_l) per layer; a MoE model's
    [L, slots, bins] -> ((t_l,slot) per slot) per layer, where a block without calibration
    tokens (or a slot without a block) takes the quantile of its layer's blocks pooled."""
    if counts.ndim == 2:
        return tuple(histogram_quantile(c, s) for c in counts)
    return tuple(
        tuple(histogram_quantile(c if c.sum() > 0 else layer.sum(axis=0), s) for c in layer) for layer in counts
    )


def thresholds_data(thresholds: dict[str, tuple]) -> dict[str, dict[str, jax.Array]]:
    """Per-layer thresholds as the calibrated data the plans read (`Method.data`, ``w.data``):
    {tensor: (t_0, ..., t_{L−1})} -> ``{"thresholds": {tensor: [L] float32}}``; a MoE model's
    per-slot thresholds (t_l a tuple over block slots) give [L, slots]."""
    return {"thresholds": {tensor: jnp.asarray(np.asarray(values, np.float32)) for tensor, values in thresholds.items()}}


def layer_threshold(table: jax.Array, layer: jax.Array, block: jax.Array | None = None) -> jax.Array:
    """This FFN block's threshold from a data table [L] float32, picked inside jit by the layer
    index ``w.layer`` and, in a MoE model (table [L, slots]), the block slot ``w.block``
    -> [] float32."""
    row = table[layer]
    return row if block is None else row[block]


def threshold_keep(v: jax.Array, valid: jax.Array, t: jax.Array, aggregate: str) -> tuple[jax.Array, jax.Array]:
    """Which entries of v [B, 1, n] survive the threshold, and the actual density.

    per_token: keep |v[b, i]| > t per row; density = kept fraction over valid rows.
    max / mean: a = max / mean over valid rows of |v| -> [n]; keep a > t for every row; density =
    kept fraction of the shared mask. -> (keep broadcastable to v, density fp32 scalar)."""
    a = jnp.abs(v.astype(jnp.float32))
    rows = valid[..., None]
    if aggregate == "per_token":
        keep = a > t
        n_valid = jnp.sum(valid)
        density = jnp.sum(jnp.where(rows, keep, False)) / jnp.maximum(n_valid * v.shape[-1], 1)
        return keep, density.astype(jnp.float32)
    keep = batch_scores(a, valid, aggregate) > t
    return keep, jnp.mean(keep.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class ThresholdMethod(SparsityBudget):
    """Base of TEAL and CATS: a budget (``ratio`` or ``ffn_sparsity``), the batch rule (one mask
    per batch from the max by default), the calibrated `Thresholds` (None until `calibrate`;
    ``bind`` needs them) and the ``kernel`` that reads the kept rows at decode: "auto" (the
    Pallas kernel on TPU and GPU, XLA on a CPU and on a mixture of experts), "xla" (masks
    before dense matmuls) or "pallas" (`popjax.methods.input_rows`: the kept rows of the
    model's FFN weights in an input-major copy, built once per model)."""

    calibrates: ClassVar[bool] = True
    aggregate: str = dataclasses.field(default="max", kw_only=True)
    thresholds: Thresholds | None = dataclasses.field(default=None, kw_only=True)
    kernel: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self):
        super().__post_init__()
        if self.thresholds is not None and not isinstance(self.thresholds, Thresholds):
            raise MethodError(f"{type(self).__name__}: thresholds={self.thresholds!r} is not a Thresholds (use calibrate)")
        check_choice("kernel", self.kernel, kernels.KERNELS)

    def resolved_kernel(self, cfg: ModelConfig) -> str:
        """What the decode step runs (`input_rows.resolve_kernel`)."""
        return resolve_kernel(type(self).__name__, self.kernel, cfg)

    def targets(self, cfg: ModelConfig) -> dict[str, tuple[str, float]]:
        """{tensor: (histogram, sparsity)} for this budget."""
        raise NotImplementedError  # pragma: no cover - interface

    def calibrate(self, model, corpus=None, **calibrate_kwargs: Any) -> "ThresholdMethod":
        """A copy with thresholds calibrated on ``corpus`` (default: the Shakespeare corpus),
        cached on disk by `popjax.calibration.calibrate`."""
        thresholds = calibrate_thresholds(unrolled(model), self.targets(model.config), corpus, **calibrate_kwargs)
        return dataclasses.replace(self, thresholds=thresholds)

    def prepare(self, model) -> "ThresholdMethod":
        """Ready for ``model``: itself when calibrated (or dense), else `calibrate` (cached)."""
        if self.thresholds is not None or self._dense(model.config):
            return self
        return self.calibrate(model)

    def data(self, model) -> dict | None:
        """The thresholds for ``model`` as arrays, checked against its budget and shape:
        ``{"thresholds": {tensor: [L] float32}}`` ([L, slots] on a MoE model; see
        `thresholds_data`); None when the budget prunes nothing (the dense plan reads none).
        With a Pallas kernel also the copy of the FFN weights that kernel reads (`kernel_data`)."""
        if self._dense(model.config):
            return None
        data = thresholds_data(self._thresholds_for(model.config))
        return data if self.resolved_kernel(model.config) == "xla" else {**data, **self.kernel_data(model)}

    def kernel_data(self, model) -> dict:
        """What a Pallas kernel step reads instead of the model's FFN weights: ``{"rows": ...}``,
        the model's FFN weights as input-major copies (`input_rows.input_rows_data`, built once
        per model and shared by every method that reads them), a second copy of them."""
        return {"rows": input_rows_data(model)}

    def _dense(self, cfg: ModelConfig) -> bool:
        """Whether the budget zeroes nothing (then ``bind`` gives the dense plan)."""
        return all(s == 0.0 for _, s in self.targets(cfg).values())

    def _thresholds_for(self, cfg: ModelConfig) -> dict[str, tuple[float, ...]]:
        name = type(self).__name__
        if self.thresholds is None:
            raise MethodError(f"{name} has no thresholds: use {name}(...).calibrate(model) (or .prepare(model)) first")
        want = {tensor: s for tensor, (_, s) in self.targets(cfg).items()}
        have = dict(self.thresholds.sparsity)
        if set(want) != set(have) or any(abs(want[t] - have[t]) > 1e-12 for t in want):
            raise MethodError(f"{name}: thresholds were calibrated for sparsity {have}, this budget needs {want}; calibrate again")
        out = {tensor: self.thresholds.get(tensor) for tensor in want}
        L = cfg.num_hidden_layers
        for tensor, values in out.items():
            if len(values) != L:
                raise MethodError(f"{name}: {len(values)} thresholds for {tensor!r}, the model has {L} layers")
            want_shape = (L,) if cfg.moe is None else (L, cfg.moe.slots(L))
            if np.shape(values) != want_shape:
                raise MethodError(
                    f"{name}: thresholds for {tensor!r} have shape {np.shape(values)}; this {cfg.model_type} model needs "
                    f"{want_shape} ({'per layer' if cfg.moe is None else 'per layer and FFN block slot'}): calibrate on it"
                )
        return out


@dataclasses.dataclass(frozen=True)
class TEALPlan(DensePrefillPlan):
    """TEAL's decode (docs/methods.md §5.5): static budget and batch rule only; the thresholds
    are the method's data, ``w.data["thresholds"]["x"]`` and ``["h"]``, each [L] float32
    ([L, slots] on a MoE model; `thresholds_data`)."""

    name: ClassVar[str] = "teal"
    sparsity: float = 0.0  # target on both tensors
    aggregate: str = "max"
    # what reads the kept inputs' weight rows at decode (`popjax.kernels.RESOLVED`, resolved at
    # bind by `kernels.choose`): "xla" (masks before dense matmuls) or a Pallas kernel reading
    # only the kept rows of the input-major copies in ``w.data["rows"]`` (`input_rows`)
    kernel: str = "xla"

    def __post_init__(self):
        check_choice("kernel", self.kernel, kernels.RESOLVED)

    def decode(self, w, state, x, step, valid):
        """x [B, 1, d], valid [B, 1] -> (y [B, 1, d], state, densities: fp32 scalars)."""
        layer, block, t = w.layer, w.block, w.data["thresholds"]
        d, keep = x.shape[-1], 1.0 - self.sparsity
        keep_x, dens_x = threshold_keep(x, valid, layer_threshold(t["x"], layer, block), self.aggregate)
        if self.kernel == "xla":
            h = activations(w.gate_up, jnp.where(keep_x, x, 0), gate_activation(w))
        else:
            h = kernel_activations(w, x, keep_x, f=self.f, expected_active=round(d * keep), kernel=self.kernel)
        keep_h, dens_h = threshold_keep(h, valid, layer_threshold(t["h"], layer, block), self.aggregate)
        if self.kernel == "xla":
            y = down_proj(jnp.where(keep_h, h, 0), w.down)
        else:
            y = kernel_down(w, h, keep_h, d=d, expected_active=self.n_keep, kernel=self.kernel)
        return y, state, {"density": (2 * dens_x + dens_h) / 3, "density_x": dens_x, "density_h": dens_h}

    def ffn_weights_read(self, d: int) -> int:
        """At the target sparsity: gate/up columns of kept x entries, down columns of kept H
        (the TPU kernel reads whole rows: `input_rows.kernel_weights_read`)."""
        keep = 1.0 - self.sparsity
        return kernel_weights_read(self.kernel, d, self.f, d * keep, self.f * keep)

    def ffn_flops_per_token(self, d: int) -> int:
        return 2 * self.ffn_weights_read(d)


@dataclasses.dataclass(frozen=True)
class TEAL(ThresholdMethod):
    """``TEAL(ratio=0.2, aggregate="max")`` or ``TEAL(ffn_sparsity=0.5)``; thresholds from
    ``.calibrate(model)`` (see the module docstring)."""

    name: ClassVar[str] = "teal"

    def targets(self, cfg):
        s = self.sparsity(cfg)
        return {"x": ("x", s), "h": ("h", s)}

    def bind(self, cfg: ModelConfig) -> Plan:
        f, s = cfg.intermediate_size, self.sparsity(cfg)
        if s == 0.0:
            return DensePlan(f=f, n_keep=f)
        self._thresholds_for(cfg)  # an unprepared or mismatched method fails here, as it always has
        return TEALPlan(f=f, n_keep=round(f * (1.0 - s)), sparsity=s, aggregate=self.aggregate, kernel=self.resolved_kernel(cfg))
