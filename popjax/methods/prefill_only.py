"""Prefill-Only Pruning (arXiv 2602.03295; SPEC §4): layers skipped in prefill only.

Deep layers matter less for understanding a prompt than for producing tokens, so prefill skips
them (time to first token) while decode uses every layer. Three parts:

* **Skipped layers** (default: the last ⌊L/3⌋): in prefill, a skipped layer passes its input
  residual stream ``x`` through unchanged.
* **Independent KV projection** (``kv="independent"``): it still writes
  ``k = RoPE(norm(x) W_k)``, ``v = norm(x) W_v`` from that input, so decode steps find complete
  caches. ``kv="calibrated"`` uses replacement projections ``W_k'``, ``W_v'`` fitted so that they
  reproduce the full model's K/V from that same input (``popjax.kv_calibration``; they live in
  the model's params, added by ``with_prefill_kv``). Ablation ``kv="none"``: skipped layers
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

from ..models.config import ModelConfig
from .base import DensePlan, Method, MethodError, Plan
from .dense import Dense

KV_MODES = ("independent", "calibrated", "none")


@dataclasses.dataclass(frozen=True)
class PrefillOnlyPlan(Plan):
    name: ClassVar[str] = "prefill-only"
    mlp: Plan = None  # the per-layer MLP method's plan
    skipped: tuple[int, ...] = ()
    kv_projection: bool = True
    boundary_token: bool = True
    calibrated_kv: bool = False  # skipped layers project K/V with their calibrated attn.prefill_kv

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

    def prefill_layer_modes(self, n_layers: int) -> tuple[str, ...]:
        skipped_mode = ("kv_calibrated" if self.calibrated_kv else "kv") if self.kv_projection else "none"
        return tuple(skipped_mode if i in self.skipped else "full" for i in range(n_layers))

    def prefix_masked_layers(self) -> frozenset[int]:
        return frozenset() if self.kv_projection else frozenset(self.skipped)

    @property
    def boundary(self) -> bool:
        return self.boundary_token


@dataclasses.dataclass(frozen=True)
class PrefillOnly(Method):
    """``PrefillOnly(skip=None, kv="independent", boundary=True, mlp_method=None)``.

    Args:
      skip: which layers prefill skips: None = the last ⌊L/3⌋ (the paper's default); an int k =
        the last k layers; a float in [0, 1) = the last ⌊skip·L⌋ layers; a list of layer indices
        (e.g. ``least_important_prefill_layers(layer_importance(...), k)``).
      kv: "independent" (skipped layers project K/V from their input), "calibrated" (with
        projections fitted to the full model's K/V: the model must come from
        ``popjax.kv_calibration.with_prefill_kv``) or "none" (ablation).
      boundary: run the last prompt token through the full model as the first decode step.
      mlp_method: the MLP method of every layer (dense when None); ``PrefillOnly() + POP(0.2)``
        sets it.
    """

    name: ClassVar[str] = "prefill-only"
    skip: int | float | tuple[int, ...] | None = None
    kv: str = "independent"
    boundary: bool = True
    mlp_method: Method | None = None

    def __post_init__(self):
        skip = self.skip
        if isinstance(skip, (list, tuple)):
            layers = tuple(skip)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
                raise MethodError(f"skip={list(skip)!r} must hold layer indices (integers)")
            if len(set(layers)) != len(layers):
                raise MethodError(f"skip={list(skip)!r} names a layer twice")
            object.__setattr__(self, "skip", tuple(sorted(layers)))
        elif isinstance(skip, bool) or not (skip is None or isinstance(skip, (int, float))):
            raise MethodError(f"skip={skip!r} is invalid; give None, a layer count, a fraction in [0, 1) or a list of layers")
        elif isinstance(skip, float) and not 0.0 <= skip < 1.0:
            raise MethodError(f"skip={skip!r} is a fraction outside [0, 1)")
        elif isinstance(skip, int) and skip < 0:
            raise MethodError(f"skip={skip!r} is negative; give the number of last layers to skip")
        if self.kv not in KV_MODES:
            raise MethodError(f"kv={self.kv!r} is not one of {KV_MODES}")
        if not isinstance(self.boundary, bool):
            raise MethodError(f"boundary={self.boundary!r} must be True or False")
        if self.mlp_method is not None and not isinstance(self.mlp_method, Method):
            raise MethodError(f"mlp_method={self.mlp_method!r} is not a popjax method")
        if isinstance(self.mlp_method, PrefillOnly):
            raise MethodError("mlp_method cannot itself be PrefillOnly")

    @classmethod
    def least_important(cls, result, k: int, **options) -> "PrefillOnly":
        """Skips the ``k`` layers with the least prefill importance in ``result`` (from
        ``popjax.layer_importance.layer_importance``; run it with ``boundary=True``, as this
        method runs)."""
        from ..layer_importance import least_important_prefill_layers

        return cls(skip=least_important_prefill_layers(result, k), **options)

    def __add__(self, other: Method) -> "PrefillOnly":
        """``PrefillOnly(...) + POP(...)``: prefill-only layer skipping with POP in every MLP."""
        return dataclasses.replace(self, mlp_method=other)

    def prepare(self, model) -> "PrefillOnly":
        """Prepares the MLP method (e.g. calibrates TEAL) for ``model``."""
        if self.mlp_method is None:
            return self
        return dataclasses.replace(self, mlp_method=self.mlp_method.prepare(model))

    def skipped_layers(self, n_layers: int) -> tuple[int, ...]:
        """The skipped layer indices for a model of ``n_layers`` (MethodError if invalid)."""
        skip = self.skip
        if isinstance(skip, tuple):
            bad = [i for i in skip if not 0 <= i < n_layers]
            if bad:
                raise MethodError(f"skip holds layers {bad} outside [0, {n_layers}) for this {n_layers}-layer model")
            layers = skip
        else:
            count = n_layers // 3 if skip is None else int(skip * n_layers) if isinstance(skip, float) else skip
            layers = tuple(range(n_layers - count, n_layers))
        if len(layers) >= n_layers:
            raise MethodError(f"skip={self.skip!r} skips all {n_layers} layers; at least one must run in prefill")
        return layers

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
            kv_projection=self.kv != "none", boundary_token=self.boundary, calibrated_kv=self.kv == "calibrated",
        )
