"""Which layers Prefill-Only Pruning skips: the ``skip`` argument checked and resolved
(shared by the method and its KV calibration, which fits one projection per skipped layer)."""

from __future__ import annotations

from ..base import MethodError


def check_skip(skip):
    """``skip`` as ``PrefillOnly(skip=...)`` takes it -> its canonical form (a list becomes a
    sorted tuple); MethodError naming the bad value otherwise."""
    if isinstance(skip, (list, tuple)):
        layers = tuple(skip)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise MethodError(f"skip={list(skip)!r} must hold layer indices (integers)")
        if len(set(layers)) != len(layers):
            raise MethodError(f"skip={list(skip)!r} names a layer twice")
        return tuple(sorted(layers))
    if isinstance(skip, bool) or not (skip is None or isinstance(skip, (int, float))):
        raise MethodError(f"skip={skip!r} is invalid; give None, a layer count, a fraction in [0, 1) or a list of layers")
    if isinstance(skip, float) and not 0.0 <= skip < 1.0:
        raise MethodError(f"skip={skip!r} is a fraction outside [0, 1)")
    if isinstance(skip, int) and skip < 0:
        raise MethodError(f"skip={skip!r} is negative; give the number of last layers to skip")
    return skip


def skipped_layers(skip, n_layers: int) -> tuple[int, ...]:
    """The skipped layer indices for a model of ``n_layers``: None = the last ⌊L/3⌋, an int k =
    the last k, a float = the last ⌊skip·L⌋, a tuple = those layers (MethodError if invalid)."""
    skip = check_skip(skip)
    if isinstance(skip, tuple):
        bad = [i for i in skip if not 0 <= i < n_layers]
        if bad:
            raise MethodError(f"skip holds layers {bad} outside [0, {n_layers}) for this {n_layers}-layer model")
        layers = skip
    else:
        count = n_layers // 3 if skip is None else int(skip * n_layers) if isinstance(skip, float) else skip
        layers = tuple(range(n_layers - count, n_layers))
    if len(layers) >= n_layers:
        raise MethodError(f"skip={skip!r} skips all {n_layers} layers; at least one must run in prefill")
    return layers
