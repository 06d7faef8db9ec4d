"""Compilation is part of the user's wait: one compile per bucket, none for new sampling values."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import popjax
from popjax import engine
from tests.conftest import random_prompts

METHODS = [
    popjax.Dense(),
    popjax.POP(ratio=0.2, gamma=0.1),
    popjax.POP(ratio=0.2, aggregate="per_sequence"),
    popjax.Static(ratio=0.2),
    popjax.Dynamic(ratio=0.2),
]


NONE = {"prefill": 0, "start": 0, "decode_loop": 0, "stream_step": 0, "teacher_force": 0}


def _delta(before: dict[str, int]) -> dict[str, int]:
    after = engine.compile_counts()
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}-{getattr(m, 'aggregate', '')}")
def test_prompts_of_one_bucket_compile_once(tiny_model, method):
    jax.clear_caches()  # count from zero, whatever earlier tests compiled
    lengths = [3, 5, 8, 11, 14, 17, 20, 24, 28, 32]  # ten lengths, all in the 32 bucket
    prompts = random_prompts(np.random.default_rng(0), lengths, tiny_model.config.vocab_size)
    before = engine.compile_counts()
    for prompt in prompts:
        popjax.generate_ids(tiny_model, [prompt], max_new_tokens=12, method=method)
    assert _delta(before) == {**NONE, "start": 1, "decode_loop": 1}

    # New max_new_tokens (same capacity bucket), temperature, top-k/p and seed: no recompile.
    before = engine.compile_counts()
    popjax.generate_ids(tiny_model, [prompts[0]], max_new_tokens=40, method=method)
    popjax.generate_ids(
        tiny_model, [prompts[3]], max_new_tokens=7, temperature=0.8, top_k=20, top_p=0.9, seed=3, method=method
    )
    assert _delta(before) == NONE


def test_batches_of_mixed_lengths_share_the_bucket(tiny_model):
    prompts = random_prompts(np.random.default_rng(1), [4, 9, 30], tiny_model.config.vocab_size)
    popjax.generate_ids(tiny_model, prompts, max_new_tokens=5)
    before = engine.compile_counts()
    popjax.generate_ids(tiny_model, prompts[::-1], max_new_tokens=9)
    assert _delta(before) == NONE
