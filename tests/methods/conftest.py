"""Fixtures of the method tests: the tiny mixture-of-experts models (tests/methods/moe_reference.py)."""

from __future__ import annotations

import pytest

from tests.methods.moe_reference import build_moe


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
    from tests.methods.test_method_matrix import ready as ready_method

    model, _ = moe_models("qwen2_moe")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = ready_method(name, "moe", model)
        return cache[name]

    return get
