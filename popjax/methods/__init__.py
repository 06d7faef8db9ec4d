"""Pruning methods behind one interface (docs/methods.md §6) and their registry."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from .base import Method, MethodError, Plan, ffn_ratio, kept_channels
from .bwap import BWAP, BWAPPlan
from .cats import CATS, CATSPlan
from .base import DensePlan
from .dense import Dense
from .dynamic import Dynamic, DynamicPlan
from .flap import FLAP
from .pop.gate_scored import GateScoredPOP
from .glass import GLASS, GLASSPlan, GlobalPrior
from .griffin import GRIFFIN, GRIFFINPlan
from .larosa import LaRoSa, LaRoSaPlan, Rotations
from .principal_teal import PrincipalTEAL, PrincipalTEALPlan
from .pop.layer_bands import BandAllocation, LayerBandsPOP
from .pop.low_rank import LowRankFactors, LowRankPOP
from .pop.core import POP, POPPlan, POPShardedPlan
from .prefill_only.method import PrefillOnly, PrefillOnlyPlan
from .probe import ProbePruning, ProbePruningPlan
from .pop.shortlist import ShortlistPOP
from .pop.shortlist_dynamic import ShortlistDynamic
from .static import Static, StaticPlan
from .teal import TEAL, TEALPlan, Thresholds
from .wanda_sp import ChannelSelection, SelectionPlan, WandaSP
from .wina import WINA, ColumnNorms, WINAPlan

METHODS: dict[str, type[Method]] = {
    cls.name: cls for cls in (Dense, POP, Static, Dynamic, GRIFFIN, ProbePruning, BWAP, TEAL, CATS, WandaSP, FLAP, PrefillOnly,
                GateScoredPOP, LowRankPOP, LayerBandsPOP, ShortlistPOP, ShortlistDynamic, WINA, GLASS, LaRoSa, PrincipalTEAL)
}


# earlier registry names still accepted (every name is hyphenated now)
ALIASES = {"wanda_sp": "wanda-sp"}


def method_class(name: str) -> type[Method]:
    """The registered class of ``name`` (or of an earlier alias); MethodError for an unknown name."""
    cls = METHODS.get(ALIASES.get(name, name))
    if cls is None:
        raise MethodError(f"unknown method {name!r}; valid methods: {sorted(METHODS)}")
    return cls


def method_fields(name: str) -> set[str]:
    """The hyper-parameter names of a registered method (MethodError for an unknown name)."""
    return set(method_class(name).hyper_parameters())


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
        if not layer.layer_level:
            raise MethodError(f"{layer_name!r} is not a layer-level method; only one MLP method can run per layer")
        return layer + make_method(mlp_name, **{k: v for k, v in hyper.items() if k in mlp_fields})
    fields = method_fields(name)
    cls = method_class(name)
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


def sweep(specs: Sequence[str], ratios: Sequence[float | None] = (None,), *, dedupe: bool = False,
          **defaults: Any) -> list[tuple[str, Method]]:
    """The one sweep builder of eval, frontier, batch study and bench: (spec, method) for each
    spec in the order given — once when it takes no ratio, else at each ratio.

    ``defaults`` are hyper-parameters given to every method (part) that takes them; a spec's own
    ``key=value`` wins. An ``aggregate`` default may be a tuple of preferences: the first value
    the method accepts (its ``aggregates`` trait) is used, none if it accepts none of them.
    ``dedupe`` drops repeated configurations (e.g. a spec fixing its own ratio)."""
    out, seen = [], set()
    for spec in specs:
        name = spec.split(":")[0]
        parts = name.split("+")
        fields = set().union(*(method_fields(part) for part in parts))  # MethodError for an unknown name
        hyper: dict[str, Any] = {}
        for key, value in defaults.items():
            if key not in fields or value is None:
                continue
            if key == "aggregate":
                accepted = set().union(*(method_class(part).aggregates for part in parts))
                value = next((v for v in (value if isinstance(value, tuple) else (value,)) if v in accepted), None)
                if value is None:
                    continue
            hyper[key] = value
        for ratio in ratios if "ratio" in fields else [None]:
            method = parse_method_spec(spec, **hyper, **({"ratio": ratio} if ratio is not None else {}))
            if dedupe and repr(method) in seen:
                continue
            seen.add(repr(method))
            out.append((spec, method))
    return out


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
    "CATS",
    "CATSPlan",
    "ChannelSelection",
    "ColumnNorms",
    "Dense",
    "DensePlan",
    "Dynamic",
    "DynamicPlan",
    "FLAP",
    "GLASS",
    "GLASSPlan",
    "GRIFFIN",
    "GRIFFINPlan",
    "GateScoredPOP",
    "GlobalPrior",
    "LaRoSa",
    "LaRoSaPlan",
    "LayerBandsPOP",
    "LowRankFactors",
    "LowRankPOP",
    "METHODS",
    "Method",
    "MethodError",
    "POP",
    "POPPlan",
    "POPShardedPlan",
    "Plan",
    "PrefillOnly",
    "PrefillOnlyPlan",
    "PrincipalTEAL",
    "PrincipalTEALPlan",
    "ProbePruning",
    "ProbePruningPlan",
    "Rotations",
    "SelectionPlan",
    "ShortlistDynamic",
    "ShortlistPOP",
    "Static",
    "StaticPlan",
    "TEAL",
    "TEALPlan",
    "Thresholds",
    "WINA",
    "WINAPlan",
    "WandaSP",
    "ffn_ratio",
    "kept_channels",
    "make_method",
    "method_class",
    "method_fields",
    "method_label",
    "parse_method_spec",
    "prepared",
    "resolve_method",
    "sweep",
]
