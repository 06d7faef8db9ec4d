"""A prompt's output does not depend on what it is batched with, by default (issue: POP's former
``aggregate="shared"`` default built one partition for unrelated prompts): every method that
partitions or selects by the prompt defaults to per-sequence statistics, and ``"shared"`` stays
the documented batch-serving option."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import kernels
from popjax.methods import METHODS, make_method, method_fields
from popjax.methods.per_sequence import decode_per_sequence
from popjax.sharding import pad_ids, take_split

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


@pytest.mark.parametrize("batch", [1, 2])
def test_a_per_sequence_step_returns_the_state_it_passed_through_as_given(batch):
    """The leaves a decode step passes through (POP's compact copies) come back as the very input
    arrays, at a batch of one too: there a row's ``a[0][None]`` would be a new array, which a
    scanned model's layer loop writes as a new stack every step (XLA:TPU then copied the whole
    stacked state per layer trip: 406 GiB per 8B step against 9.3 unrolled)."""

    def shared(w, state, x, step, valid):  # keeps "copy", advances "count"
        return x * 2, {"copy": state["copy"], "count": state["count"] + 1}, {}

    state = {"copy": jnp.ones((batch, 4, 3)), "count": jnp.zeros((batch,), jnp.int32)}
    x, valid = jnp.ones((batch, 1, 3)), jnp.ones((batch, 1), bool)
    jaxpr = jax.make_jaxpr(lambda s: decode_per_sequence(shared, None, s, x, 0, valid)[1])(state).jaxpr
    (copy_in, count_in), (copy_out, count_out) = jaxpr.invars, jaxpr.outvars
    assert copy_out is copy_in and count_out is not count_in
    new = decode_per_sequence(shared, None, state, x, 0, valid)[1]
    assert new["count"].tolist() == [1] * batch and new["copy"].shape == (batch, 4, 3)


def test_compact_copies_are_padded_with_zero_channels_to_a_multiple_of_8_on_a_tpu():
    """Traced for a TPU, a copy of 13 channels holds 16: the 3 padding channels are zeros (they
    add exactly 0 to the FFN), and a copy of 8 is not padded. On this CPU nothing is padded."""
    w = jnp.arange(20 * 3, dtype=jnp.float32).reshape(20, 3) + 1
    ids = jnp.array([19, 0, 4, 7, 1, 2, 3, 5, 6, 8, 9, 10, 11])
    assert take_split(w, pad_ids(ids), axis=0).shape == (13, 3)
    with kernels.compiling_for("tpu"):
        copy = take_split(w, pad_ids(ids), axis=0)
        assert pad_ids(ids[:8]).shape == (8,)
    assert copy.shape == (16, 3)
    np.testing.assert_array_equal(copy[:13], w[ids])
    np.testing.assert_array_equal(copy[13:], 0)
