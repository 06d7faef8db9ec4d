"""A prompt's output does not depend on what it is batched with, by default (issue: POP's former
``aggregate="shared"`` default built one partition for unrelated prompts): every method that
partitions or selects by the prompt defaults to per-sequence statistics, and ``"shared"`` stays
the documented batch-serving option."""

from __future__ import annotations

import numpy as np
import pytest

import popjax
from popjax.methods import METHODS, make_method, method_fields

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 11, 12], [8, 9, 10, 100, 101, 102]]
PARTITIONING = ("pop", "static", "dynamic", "griffin", "probe", "pop-shortlist", "pop-gate", "glass")


def test_prompt_partitioning_methods_default_to_per_sequence():
    for name in PARTITIONING:
        assert name in METHODS, name
        method = make_method(name)
        assert method.aggregate == "per_sequence" and method.batch_independent, name
    # the batch-serving mode is still there, and says it shares
    assert not popjax.POP(0.2, aggregate="shared").batch_independent


@pytest.mark.parametrize("name", ["pop", "static", "griffin", "probe"])
def test_batched_greedy_tokens_equal_each_prompt_alone(tiny_model, name):
    method = make_method(name, ratio=0.3)
    if method.needs_calibration:
        method = method.prepare(tiny_model)
    batched, _ = popjax.generate_ids(tiny_model, PROMPTS, max_new_tokens=6, method=method, stop_ids=[])
    alone = [popjax.generate_ids(tiny_model, [p], max_new_tokens=6, method=method, stop_ids=[])[0][0] for p in PROMPTS]
    assert batched == alone, name


def test_shared_aggregate_is_one_partition_per_batch(tiny_model):
    """With ``aggregate="shared"`` both rows get one partition (the batch-serving trade-off)."""
    shared = popjax.POP(0.3, aggregate="shared")
    trace = popjax.generate_ids(tiny_model, PROMPTS, max_new_tokens=3, method=shared, return_trace=True)[1]
    per_row = popjax.generate_ids(tiny_model, PROMPTS, max_new_tokens=3, method=popjax.POP(0.3), return_trace=True)[1]
    L = tiny_model.config.num_hidden_layers
    assert np.asarray(trace["partition"]["candidate_idx"]).shape[0] == L
    assert np.asarray(trace["partition"]["candidate_idx"]).ndim == 2  # [L, 2m]: one for the batch
    assert np.asarray(per_row["partition"]["candidate_idx"]).shape[:2] == (L, len(PROMPTS))  # [L, B, 2m]
    assert "aggregate" in method_fields("pop")
