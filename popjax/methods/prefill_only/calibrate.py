"""``calibrate_kv``: the calibrated K/V projections of Prefill-Only Pruning's skipped layers
(docs/methods.md §8), read from the cache or fitted — in closed form (``kv_calibration``) or by
training with optax (``kv_training``) — and written to the cache (``kv_store``)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...calibration import DEFAULT_WINDOW, model_fingerprint
from ...loaded import LoadedModel
from . import kv_store, kv_training
from .kv_calibration import (
    DEFAULT_BATCH, DEFAULT_RIDGE, METHODS, KVCalibration, KVCalibrationError, calibration_corpus, check_ridge,
    fit_closed_form, resolve_skip,
)

log = logging.getLogger(__name__)


def calibrate_kv(
    model: LoadedModel,
    skip=None,
    prompts=None,
    *,
    ridge: float = DEFAULT_RIDGE,
    method: str = "closed_form",
    tokens: int | None = None,
    window: int = DEFAULT_WINDOW,
    batch_size: int = DEFAULT_BATCH,
    cache: bool = True,
    cache_dir=None,
    **optax_settings: Any,
) -> KVCalibration:
    """Fits the skipped layers' KV projections (see the module docstring), or reads them from the
    cache (``kv_store``: a `popjax.cache` entry of kind "kv_calibration", keyed by model, skip
    set, corpus, method, ridge and settings; the fit runs only when there is none).

    Args:
      model: a ``popjax.load`` result.
      skip: the skipped layers, as ``PrefillOnly(skip=...)`` takes them (None = last third).
      prompts: calibration text: a `Corpus`, texts, or token-id lists (concatenated and cut into
        windows); None = Shakespeare without the held-out and dev plays.
      ridge: λ ≥ 0 of the closed form, relative to the mean eigenvalue of ZᵀZ.
      method: "closed_form" or "optax" (then ``steps``, ``learning_rate``, ``weight_decay``,
        ``prefix`` as in `popjax.methods.prefill_only.kv_training.fit_optax`).
      tokens: calibration tokens (default 16384 closed form, 4096 optax); window: tokens per window.
      cache: False always fits and writes nothing; cache_dir: the cache root for this call
        (entries go to ``<cache_dir>/kv_calibration/``), default `popjax.cache.cache_root()`.
    """
    if method not in METHODS:
        raise KVCalibrationError(f"method={method!r} is not one of {METHODS}")
    if method == "closed_form" and optax_settings:
        raise KVCalibrationError(f"{sorted(optax_settings)} only apply to method='optax'")
    unknown = sorted(set(optax_settings) - {"steps", "learning_rate", "weight_decay", "prefix"})
    if unknown:
        raise KVCalibrationError(f"unknown optax settings {unknown}; valid: steps, learning_rate, weight_decay, prefix")
    ridge = check_ridge(ridge)
    skip = resolve_skip(skip, model.config.num_hidden_layers)
    if tokens is None and prompts is None and method == "optax":
        tokens = kv_training.DEFAULT_TOKENS
    corpus = calibration_corpus(model, prompts, tokens, window)
    settings = kv_training.settings(corpus.window, **optax_settings) if method == "optax" else {}
    key = {
        "format": kv_store.FORMAT, "model": model_fingerprint(model), "skip": list(skip),
        "n_layers": model.config.num_hidden_layers, "method": method, "ridge": ridge if method == "closed_form" else None,
        "corpus": {"name": corpus.name, "tokens": corpus.n_tokens, "window": corpus.window, "ids": corpus.fingerprint()},
        "settings": settings, "batch_size": batch_size,
    }

    def fit() -> KVCalibration:
        if method == "closed_form":
            weights, report = fit_closed_form(model, skip, corpus, ridge, batch_size)
        else:
            weights, report = kv_training.fit_optax(model, skip, corpus, batch_size=batch_size, **settings)
        d = model.config.hidden_size
        return KVCalibration(
            skip=skip,
            weights={l: np.asarray(w[:, :d], np.float32) for l, w in weights.items()},
            biases={l: np.asarray(w[:, d], np.float32) for l, w in weights.items()} if model.config.qkv_bias else {},
            key=key,
            fit=report,
        )

    if not cache:
        return fit()
    result, entry = kv_store.cached(key, fit, cache_dir)
    log.info("calibrated KV projections for layers %s: %s", list(skip), entry)
    return result
