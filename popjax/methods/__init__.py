"""Pruning methods behind one interface (SPEC §6) and their registry."""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Method, MethodError, Plan, ffn_ratio, kept_channels
from .dense import Dense, DensePlan
from .dynamic import Dynamic, DynamicPlan
from .pop import POP, POPPlan
from .static import Static, StaticPlan

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Dense, POP, Static, Dynamic)}


def make_method(name: str, **hyper: Any) -> Method:
    """A method by registry name; ``hyper`` holds its hyper-parameters (None values are dropped).

    Raises MethodError for an unknown name or a hyper-parameter the method does not take."""
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r}; valid methods: {sorted(METHODS)}")
    cls = METHODS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in hyper.items() if v is not None}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise MethodError(f"method {name!r} takes no {unknown}; its hyper-parameters: {sorted(fields)}")
    return cls(**given)


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
    "METHODS",
    "Dense",
    "DensePlan",
    "Dynamic",
    "DynamicPlan",
    "Method",
    "MethodError",
    "POP",
    "POPPlan",
    "Plan",
    "Static",
    "StaticPlan",
    "ffn_ratio",
    "kept_channels",
    "make_method",
    "resolve_method",
]
