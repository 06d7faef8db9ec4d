"""Fixtures of the method tests: the tiny mixture-of-experts models (tests/reference/moe.py), the
methods made ready for them, and the tiny Gemma 3 models beside their NumPy reference
(tests/reference/gemma3.py)."""

from __future__ import annotations

import pytest

import popjax
from tests.reference.gemma3 import RefGemma3
from tests.reference.matrix import ready as ready_method
from tests.reference.moe import build_moe


@pytest.fixture(scope="module")
def moe_models():
    """kind ("qwen2_moe", "qwen3_moe") -> (model, HF-layout weights), built once per test file."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = build_moe(kind)
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def moe_ready(moe_models):
    """name -> the registered method ready for the mixed Qwen2-MoE model (memoised, as the method
    matrix readies it: prefill-only skips the MoE layer, its experts' states from the boundary token)."""
    model, _ = moe_models("qwen2_moe")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = ready_method(name, "moe", model)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def gemma(tiny_checkpoints):
    """name -> (unrolled model, scanned model, RefGemma3), built once per module."""
    built = {}

    def get(name):
        if name not in built:
            directory, hf = tiny_checkpoints(name)
            built[name] = (popjax.load(directory, cache=False), popjax.load(directory, cache=False, scan_layers=True),
                           RefGemma3(hf))
        return built[name]

    return get
