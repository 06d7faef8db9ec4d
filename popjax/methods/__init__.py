"""Pruning methods behind one interface (SPEC §6) and their registry."""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Method, MethodError, Plan, ffn_ratio, kept_channels
from .bwap import BWAP, BWAPPlan
from .cats import CATS, CATSPlan
from .base import DensePlan
from .dense import Dense
from .dynamic import Dynamic, DynamicPlan
from .flap import FLAP
from .gate_scored import GateScoredPlan, GateScoredPOP
from .griffin import GRIFFIN, GRIFFINPlan
from .layer_bands import BandAllocation, LayerBandsPlan, LayerBandsPOP
from .low_rank import LowRankFactors, LowRankPlan, LowRankPOP
from .pop import POP, POPPlan, POPShardedPlan
from .prefill_only import PrefillOnly, PrefillOnlyPlan
from .probe import ProbePruning, ProbePruningPlan
from .shortlist import ShortlistPlan, ShortlistPOP
from .shortlist_dynamic import ShortlistDynamic, ShortlistDynamicPlan
from .static import Static, StaticPlan
from .teal import TEAL, TEALPlan, Thresholds
from .wanda_sp import ChannelSelection, SelectionPlan, WandaSP

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (Dense, POP, Static, Dynamic, GRIFFIN, ProbePruning, BWAP, TEAL, CATS, WandaSP, FLAP, PrefillOnly,
                GateScoredPOP, LowRankPOP, LayerBandsPOP, ShortlistPOP, ShortlistDynamic)
}


def method_fields(name: str) -> set[str]:
    """The hyper-parameter names of a registered method (MethodError for an unknown name)."""
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r}; valid methods: {sorted(METHODS)}")
    return {f.name for f in dataclasses.fields(METHODS[name])}


def make_method(name: str, **hyper: Any) -> Method:
    """A method by registry name; ``hyper`` holds its hyper-parameters (None values are dropped).
    ``"prefill-only+pop"`` composes a layer-level method with an MLP method, each taking the
    hyper-parameters it has.

    Raises MethodError for an unknown name or a hyper-parameter the method does not take."""
    if "+" in name:
        layer_name, mlp_name = name.split("+", 1)
        layer_fields, mlp_fields = method_fields(layer_name), method_fields(mlp_name)
        unknown = sorted(k for k, v in hyper.items() if v is not None and k not in layer_fields | mlp_fields)
        if unknown:
            raise MethodError(f"method {name!r} takes no {unknown}; its hyper-parameters: {sorted(layer_fields | mlp_fields)}")
        layer = make_method(layer_name, **{k: v for k, v in hyper.items() if k in layer_fields})
        if not hasattr(layer, "mlp_method"):
            raise MethodError(f"{layer_name!r} is not a layer-level method; only one MLP method can run per layer")
        return layer + make_method(mlp_name, **{k: v for k, v in hyper.items() if k in mlp_fields})
    fields = method_fields(name)
    cls = METHODS[name]
    given = {k: v for k, v in hyper.items() if v is not None}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise MethodError(f"method {name!r} takes no {unknown}; its hyper-parameters: {sorted(fields)}")
    return cls(**given)


def method_label(method: Method, exclude: tuple[str, ...] = ()) -> str:
    """A short label: the name plus the hyper-parameters that differ from their defaults
    (composed methods show both parts), e.g. ``prefill-only(kv=none)+pop(gamma=0.2)``;
    calibration results held by a method (thresholds, selections) are not shown."""
    parts, inner = [], None
    for f in dataclasses.fields(method):
        value = getattr(method, f.name)
        if isinstance(value, Method):
            inner = value
        elif f.name not in exclude and value != f.default and isinstance(value, (int, float, str, bool, tuple)):
            parts.append(f"{f.name}={value}")
    label = method.name + (f"({', '.join(parts)})" if parts else "")
    return label if inner is None else f"{label}+{method_label(inner, exclude)}"


def parse_method_spec(spec: str, **hyper: Any) -> Method:
    """``"name"`` or ``"name:key=value:key=value"`` (values: numbers, true/false, text) -> a method,
    with ``hyper`` as defaults that the spec overrides (CLI sweeps: ``prefill-only:kv=none``)."""
    name, *pairs = spec.split(":")
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise MethodError(f"method spec {spec!r}: {pair!r} is not key=value")
        hyper[key] = _spec_value(text)
    return make_method(name, **hyper)


def _spec_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def prepared(method: Method | str | None, model) -> Method:
    """``resolve_method`` then ``Method.prepare(model)``: what generate/forward/eval run."""
    return resolve_method(method).prepare(model)


def resolve_method(method: Method | str | None) -> Method:
    """None -> Dense(); a name -> its default instance; a Method passes through."""
    if method is None:
        return Dense()
    if isinstance(method, str):
        return make_method(method)
    if not isinstance(method, Method):
        raise MethodError(f"method={method!r} is neither a popjax method nor a name in {sorted(METHODS)}")
    return method


__all__ = [
    "BWAP",
    "BWAPPlan",
    "BandAllocation",
    "GateScoredPOP",
    "GateScoredPlan",
    "LayerBandsPOP",
    "LayerBandsPlan",
    "LowRankFactors",
    "LowRankPOP",
    "ShortlistPlan",
    "ShortlistPOP",
    "ShortlistDynamic",
    "ShortlistDynamicPlan",
    "LowRankPlan",
    "ChannelSelection",
    "CATS",
    "CATSPlan",
    "METHODS",
    "Dense",
    "DensePlan",
    "Dynamic",
    "DynamicPlan",
    "FLAP",
    "GRIFFIN",
    "GRIFFINPlan",
    "Method",
    "MethodError",
    "POP",
    "POPPlan",
    "POPShardedPlan",
    "PrefillOnly",
    "PrefillOnlyPlan",
    "Plan",
    "ProbePruning",
    "ProbePruningPlan",
    "SelectionPlan",
    "Static",
    "StaticPlan",
    "TEAL",
    "TEALPlan",
    "Thresholds",
    "WandaSP",
    "ffn_ratio",
    "kept_channels",
    "make_method",
    "method_fields",
    "method_label",
    "parse_method_spec",
    "prepared",
    "resolve_method",
]
