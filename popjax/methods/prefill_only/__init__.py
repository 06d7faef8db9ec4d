"""Prefill-Only Pruning (docs/methods.md §4): the method (``method``), the calibrated K/V
projections of its skipped layers (``kv_calibration``, fitted in closed form or trained in
``kv_training``, kept in the cache by ``kv_store``; §8)."""

from .method import PrefillOnly, PrefillOnlyPlan

__all__ = ["PrefillOnly", "PrefillOnlyPlan"]
