"""What the 8-device worker (tests/scale/eight_devices.py, one subprocess with 8 fake CPU devices)
found: every method's tokens and log-probabilities on the (2, 4) mesh (and (8, 1) where a method
reduces over rows) against one device, int8 weights on meshes, the collectives and split copies of
the compiled prefill and decode step on (1, 8), and checkpoints restored straight into their
shardings.
"""

from __future__ import annotations

import json

import pytest

from tests.scale.eight_devices import INT8_METHODS, check_methods, core_meshes, core_methods, other_methods, run_worker, tiny_config


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory) -> dict:
    """The one subprocess with 8 fake devices (the rest of the suite keeps one), run once for
    both tests below: every method, the generate loop and the collective counts."""
    return run_worker(tmp_path_factory.mktemp("eight_devices"), "--all")


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_other_methods(eight_devices):
    """Every registered method (calibrated ones on random tokens) matches one device on the
    (2, 4) mesh, which splits both the batch and the channels (the core methods of the next test
    on (8, 1) as well where they reduce over rows): log-probabilities within 1e-5, the same greedy choices."""
    from popjax.methods import METHODS

    assert set(other_methods(None)) <= set(eight_devices["methods"])
    assert set(METHODS) <= set(eight_devices["registry_names"]), sorted(set(METHODS) - set(eight_devices["registry_names"]))
    for name, entry in eight_devices["methods"].items():
        assert set(entry) == ({str(shape) for shape in core_meshes(name)} if name in core_methods() else {"(2, 4)"}), (name, entry)
    check_methods(eight_devices)


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_int8_weights(eight_devices):
    """An int8 model (popjax/kernels/int8.py) on meshes (1, 8) and (2, 4): every scale is split like
    the output axes of its weight, and dense, static and POP (shared, per shard) give one
    device's log-probabilities and greedy choices on the (2, 4) mesh."""
    int8 = eight_devices["int8"]
    assert int8["scales_checked"] >= 8 and not int8["scales_split_unlike_weights"], int8
    assert set(int8["methods"]) == set(INT8_METHODS)
    check_methods({"methods": int8["methods"]})
    assert int8["step_row_formats"] == {"pop-gate": ["int8"], "pop-shortlist": ["int8"]}, int8["step_row_formats"]


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_match_one_device(eight_devices):
    """Dense, static and POP (shared, per sequence, per shard) give the log-probabilities and
    greedy choices of one device on the (2, 4) mesh, and those that reduce over rows on (8, 1)
    as well (`BATCH_ONLY_METHODS`); the greedy loop of POP per shard its tokens; the compiled
    decode step on (1, 8)
    moves no weights and, but for the global partition's scores, no activations between devices
    (nor do BWAP's, or per-shard POP's with weights="gather", which gathers
    its rows from the model's [2, f, d] gate/up at every step: each shard from its own block)."""
    results = eight_devices
    print(json.dumps(results, indent=1))  # the collective counts, for docs/sharding.md (pytest -s)
    assert results["devices"] == 8
    assert set(core_methods()) <= set(results["methods"])
    check_methods(results)
    assert all(results["generate"].values()), results["generate"]
    for name, found in results["collectives"].items():
        assert found["counts"]["all-to-all"] == 0, (name, found)
        assert found["largest_all_gather"] < found["weight_threshold_elements"], (name, found)
        if name != "pop-shared":  # q/k/v grouped by KV head: attention moves nothing between devices;
            # only the global partition's candidate selection (pop-shared) permutes scores
            assert found["counts"]["collective-permute"] == 0, (name, found)


# Replicated by design: rows every decode step gathers its selection from (by positions that differ
# per step) and the low-rank scoring factors.
CANDIDATE_ROWS = {"down_candidates", "up_candidates", "gate_up_candidates", "band_gate_up", "band_down_rows",
                  "score_in", "score_out"}
# candidate rows (pop-gate: up and down, 2·n_C·d) and scoring factors outweigh their split blocks here
CANDIDATE_HEAVY = {"pop-gate", "pop-lowrank", "pop-bands"}


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_compact_copies_are_split(eight_devices):
    """Static, POP (global partition, shared or per sequence, and per shard), BWAP, Wanda-sp and
    POP's variants (gate-scored, low-rank, layer bands) keep their compact copies split over the
    model axis: one device of the (1, 8) mesh holds under a quarter of the method state (the kept
    rows and the per-shard blocks are 1/8; candidate rows that every step gathers from, replicated,
    are the rest), and the prefill that copies them never all-gathers an
    FFN weight matrix (before base.copy_channels, per-sequence POP's prefill gathered all of
    gate_up and [B, 2, n_R + n_C, d] blocks)."""
    cfg = tiny_config()
    threshold = cfg.hidden_size * cfg.intermediate_size  # the smallest FFN weight matrix, d·f
    for name, found in eight_devices["state_after_prefill"].items():
        assert found["one_device"] < found["total"] / 4 or name in CANDIDATE_HEAVY, (name, found)
        # every other leaf is split 8 ways exactly (padded to a multiple of 8 channels)
        split = found["total"] - found["replicated_bytes"]
        assert 8 * (found["one_device"] - found["replicated_bytes"]) == split, (name, found)
        assert set(found["replicated_weights"]) <= CANDIDATE_ROWS, (name, found)
        assert found["prefill_largest_all_gather"] < threshold, (name, found)


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_restore_into_shardings(eight_devices):
    """``popjax.load(converted dir, mesh=(1, 8))`` restores every tensor straight into its
    sharding (no host placement), unrolled and scanned, with the host path's exact values."""
    # Two layers of six tensors plus embedding, final norm and LM head; scanned: one stack per kind.
    expected_leaves = {"unrolled": 2 * 6 + 3, "scanned": 6 + 3}
    assert set(eight_devices["restore"]) == set(expected_leaves), eight_devices["restore"]
    for layout, found in eight_devices["restore"].items():
        assert found["leaves"] == expected_leaves[layout], (layout, found)
        assert found["max_abs_diff"] == 0.0, (layout, found)
        assert found["max_abs_diff_derived"] <= 1e-6, (layout, found)
        assert found["wrong_shardings"] == [], (layout, found)
