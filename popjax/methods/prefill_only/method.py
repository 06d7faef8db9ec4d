"""Prefill-Only Pruning (arXiv 2602.03295; docs/methods.md §4): layers skipped in prefill only.

Deep layers matter less for understanding a prompt than for producing tokens, so prefill skips
them (time to first token) while decode uses every layer. Three parts:

* **Skipped layers** (default: the last ⌊L/3⌋): in prefill, a skipped layer passes its input
  residual stream ``x`` through unchanged.
* **Independent KV projection** (``kv="independent"``): it still writes
  ``k = RoPE(norm(x) W_k)``, ``v = norm(x) W_v`` from that input, so decode steps find complete
  caches. ``kv="calibrated"`` uses replacement projections ``W_k'``, ``W_v'`` fitted so that they
  reproduce the full model's K/V from that same input (``calibrate.calibrate_kv``; the method's
  calibrated data, passed into the compiled prefill beside the params). Ablation ``kv="none"``: skipped layers
  write nothing and their decode attention ignores the prefilled slots.
* **Boundary token** (``boundary=True``): prefill covers prompt tokens 1..N−1; token N runs the
  full model as the first decode-path step, so the first generated token sees every layer.
  Ablation ``boundary=False``: the whole prompt is prefilled (the first token then comes from
  the pruned pass).

Composition with an MLP method (``PrefillOnly() + POP(0.2)``, or ``mlp_method=``): every layer's
MLP runs that method. A skipped layer never runs its FFN on the prompt, so it has no prefill
statistics: its method state (POP's partition, static's kept set, ...) is built from the
boundary token, the one prompt token the full model processes. Without a boundary there is no
such token, so the combination is refused with a clear error.

A one-token prompt leaves nothing to prefill: the boundary step processes it with the full
model, so generation equals the MLP method's own (dense by default).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...models.config import ModelConfig
from ...models.interface import LayerControl
from ..base import DensePlan, Method, MethodError, Plan
from ..dense import Dense
from .calibrate import calibrate_kv
from .kv_calibration import KVCalibration, check_calibration, kv_weights
from .skip import check_skip, skipped_layers

KV_MODES = ("independent", "calibrated", "none")


@dataclasses.dataclass(frozen=True)
class PrefillOnlyPlan(Plan):
    name: ClassVar[str] = "prefill-only"
    mlp: Plan = None  # the per-layer MLP method's plan
    skipped: tuple[int, ...] = ()  # the layers ``skip`` resolves to for this model
    kv: str = "independent"  # as PrefillOnly's; "calibrated" reads the method's data
    boundary: bool = True  # the engine's boundary-token hook (`popjax.ffn.Plan.boundary`)

    def prefill(self, w, x, valid):
        return self.mlp.prefill(w, x, valid)

    def decode(self, w, state, x, step, valid):
        return self.mlp.decode(w, state, x, step, valid)

    def ffn_flops_per_token(self, d: int) -> int:
        return self.mlp.ffn_flops_per_token(d)

    def ffn_weights_read(self, d: int) -> int:
        return self.mlp.ffn_weights_read(d)

    def ffn_weights_read_per_step(self, d: int, batch: int) -> int:
        return self.mlp.ffn_weights_read_per_step(d, batch)

    def layer_control(self, n_layers: int, data=None) -> LayerControl:
        """Prefill skips the ``skipped`` layers: they only project K/V ("kv": with their own rows,
        or with the calibrated projections in ``data["kv_weights"]``) or, with ``kv="none"``, write
        nothing, and their attention ignores the prompt's slots in decode."""
        skipped_mode = "none" if self.kv == "none" else "kv"
        return LayerControl(
            tuple(skipped_mode if i in self.skipped else "full" for i in range(n_layers)),
            prefix_masked=frozenset(self.skipped) if self.kv == "none" else frozenset(),
            kv_weights=data["kv_weights"] if self.kv == "calibrated" else None,
        )

    @property
    def requires_data(self) -> bool:
        return self.kv == "calibrated" or self.mlp.requires_data


@dataclasses.dataclass(frozen=True)
class PrefillOnly(Method):
    """``PrefillOnly(skip=None, kv="independent", boundary=True, mlp_method=None)``.

    Args:
      skip: which layers prefill skips: None = the last ⌊L/3⌋ (the paper's default); an int k =
        the last k layers; a float in [0, 1) = the last ⌊skip·L⌋ layers; a list of layer indices
        (e.g. ``least_important_prefill_layers(layer_importance(...), k)``).
      kv: "independent" (skipped layers project K/V from their input), "calibrated" (with
        projections fitted to reproduce the full model's K/V: ``prepare`` fits them once per
        model and skip set, cached, or takes ``kv_calibration``) or "none" (ablation).
      kv_calibration: a ``calibrate_kv`` result to use with ``kv="calibrated"`` (e.g. fitted on
        your own corpus); None = fitted by ``prepare`` on the default corpus.
      boundary: run the last prompt token through the full model as the first decode step.
      mlp_method: the MLP method of every layer (dense when None); ``PrefillOnly() + POP(0.2)``
        sets it.
    """

    name: ClassVar[str] = "prefill-only"
    layer_level: ClassVar[bool] = True
    skip: int | float | tuple[int, ...] | None = None
    kv: str = "independent"
    boundary: bool = True
    mlp_method: Method | None = None
    kv_calibration: KVCalibration | None = None

    def __post_init__(self):
        object.__setattr__(self, "skip", check_skip(self.skip))
        if self.kv not in KV_MODES:
            raise MethodError(f"kv={self.kv!r} is not one of {KV_MODES}")
        if not isinstance(self.boundary, bool):
            raise MethodError(f"boundary={self.boundary!r} must be True or False")
        if self.mlp_method is not None and not isinstance(self.mlp_method, Method):
            raise MethodError(f"mlp_method={self.mlp_method!r} is not a popjax method")
        if isinstance(self.mlp_method, PrefillOnly):
            raise MethodError("mlp_method cannot itself be PrefillOnly")
        if self.kv_calibration is not None and self.kv != "calibrated":
            raise MethodError(f"kv_calibration is given but kv={self.kv!r}; it is used with kv='calibrated' only")
        if self.kv_calibration is not None and not isinstance(self.kv_calibration, KVCalibration):
            raise MethodError(f"kv_calibration={self.kv_calibration!r} is not a calibrate_kv result (KVCalibration)")

    @classmethod
    def least_important(cls, result, k: int, **options) -> "PrefillOnly":
        """Skips the ``k`` layers with the least prefill importance in ``result`` (from
        ``popjax.analysis.layer_importance.layer_importance``, a ``LayerImportance``; run it with ``boundary=True``, as this
        method runs)."""
        return cls(skip=result.least_important_prefill(k), **options)

    @property
    def ffn_method(self) -> Method:
        return self.mlp_method if self.mlp_method is not None else Dense()

    @property
    def needs_calibration(self) -> bool:
        return self.kv == "calibrated" or self.ffn_method.needs_calibration

    @property
    def batch_independent(self) -> bool:
        # the layer choice is per model; the FFN method decides
        return self.ffn_method.batch_independent

    def __add__(self, other: Method) -> "PrefillOnly":
        """``PrefillOnly(...) + POP(...)``: prefill-only layer skipping with POP in every MLP."""
        return dataclasses.replace(self, mlp_method=other)

    def prepare(self, model) -> "PrefillOnly":
        """Prepares the MLP method (e.g. calibrates TEAL) for ``model`` and, with
        ``kv="calibrated"``, the skipped layers' K/V projections (`calibrate_kv`: fitted once per
        model and skip set, then read from the cache; a given ``kv_calibration`` is checked)."""
        method = self if self.mlp_method is None else dataclasses.replace(self, mlp_method=self.mlp_method.prepare(model))
        if self.kv != "calibrated":
            return method
        skipped = self.skipped_layers(model.config.num_hidden_layers)
        calibration = self.kv_calibration if self.kv_calibration is not None else calibrate_kv(model, skipped)
        check_calibration(calibration, model, skipped)
        return dataclasses.replace(method, kv_calibration=calibration)

    def data(self, model) -> dict | None:
        """The FFN method's data, plus ``{"kv_weights": {layer: (w [n_kv, 2, h, d], bias or None)}}``
        with ``kv="calibrated"`` (the schedule's K/V projection of each skipped layer)."""
        inner = None if self.mlp_method is None else self.mlp_method.data(model)
        if self.kv != "calibrated":
            return inner
        if self.kv_calibration is None:
            raise MethodError("PrefillOnly(kv='calibrated') is not prepared: call method.prepare(model) first "
                              "(popjax.generate and forward do)")
        return {**(inner or {}), "kv_weights": kv_weights(self.kv_calibration, model)}

    def skipped_layers(self, n_layers: int) -> tuple[int, ...]:
        """The skipped layer indices for a model of ``n_layers`` (MethodError if invalid)."""
        return skipped_layers(self.skip, n_layers)

    def bind(self, cfg: ModelConfig) -> Plan:
        mlp = (self.mlp_method or Dense()).bind(cfg)
        layers = self.skipped_layers(cfg.num_hidden_layers)
        if not layers:
            return mlp
        if not self.boundary and not isinstance(mlp, DensePlan):
            raise MethodError(
                f"PrefillOnly(boundary=False) cannot be combined with {self.mlp_method.name}: skipped layers never "
                "run their FFN on the prompt, and without the boundary token no prompt token builds their state"
            )
        return PrefillOnlyPlan(
            f=mlp.f, n_keep=mlp.n_keep, mlp=mlp, skipped=layers,
            kv=self.kv, boundary=self.boundary,
        )
