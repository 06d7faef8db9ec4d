"""Paired statistics against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import numpy as np
import pytest

from popjax.eval import paired


def test_wilson_interval_matches_hand_computed_values():
    # n = 100, p = 0.5, z = 1.96: centre 0.5; half = 1.96·sqrt(0.0025 + 0.000096)/1.0384 = 0.0962
    assert paired.wilson_interval(0.5, 100) == pytest.approx((0.4038, 0.5962), abs=1e-4)
    # n = 10, p = 1: lower = (1 + 0.1921)/1.3841 − 1.96·sqrt(0.009604)/1.3841 = 0.8613 − 0.1388 = 0.7225
    assert paired.wilson_interval(1.0, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert paired.wilson_interval(0.0, 10)[0] == 0.0 and paired.wilson_interval(0.3, 0) == (0.0, 1.0)


def test_mcnemar_exact_is_the_two_sided_binomial_tail_on_discordant_pairs():
    # b = 1, c = 6: n = 7, P(X ≤ 1) = (1 + 7)/128, two-sided 16/128
    assert paired.mcnemar_exact(1, 6) == pytest.approx(0.125)
    assert paired.mcnemar_exact(6, 1) == pytest.approx(0.125)
    assert paired.mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # both tails of an all-one-way split
    assert paired.mcnemar_exact(3, 3) == 1.0 and paired.mcnemar_exact(0, 0) == 1.0  # capped at 1 / nothing to test
    # b = 2, c = 10: (1 + 12 + 66)/4096 · 2 = 158/4096
    assert paired.mcnemar_exact(2, 10) == pytest.approx(158 / 4096)
    assert 0 < paired.mcnemar_exact(600, 800) < 1e-6  # exact integers: no underflow at large n
    with pytest.raises(ValueError, match="b=-1"):
        paired.mcnemar_exact(-1, 2)


def test_paired_comparison_counts_discordant_questions_and_bounds_the_difference():
    dense = [1, 1, 1, 0, 0, 1, 0, 1]
    other = [1, 0, 1, 1, 0, 0, 0, 1]
    out = paired.paired_comparison(dense, other)
    # only dense right: questions 2 and 6 (b = 2); only the other right: question 4 (c = 1)
    assert (out["b"], out["c"], out["n"]) == (2, 1, 8) and out["diff"] == pytest.approx(-1 / 8)
    assert out["p"] == pytest.approx(1.0)  # 2·(1 + 3)/8 = 1
    lo, hi = out["diff_ci"]
    assert lo < out["diff"] < hi
    with pytest.raises(ValueError, match="same questions: 3 vs 2"):
        paired.discordant([1, 0, 1], [1, 0])
    with pytest.raises(ValueError, match="0/1 per question"):
        paired.discordant([1, 0.5], [1, 0])


def test_newcombe_interval_reference_cases():
    # identical grades: phi = 1 and both Wilson intervals equal -> the interval collapses to 0
    same = [1] * 5 + [0] * 5
    assert paired.newcombe_interval(same, same) == pytest.approx((0.0, 0.0), abs=1e-12)
    # the 2x2 table a = b = c = d = 1 (n = 4): phi = 0, p = 0.5 each; Wilson(0.5, 4) = 0.5 ± 0.34997,
    # so the difference's half-width is sqrt(2)·0.34997 = 0.49493
    first, second = [1, 1, 0, 0], [1, 0, 1, 0]
    assert paired.newcombe_interval(first, second) == pytest.approx((-0.49493, 0.49493), abs=1e-4)


def test_mean_rank_and_mean_accuracy_over_tasks():
    accuracy = np.array([[0.8, 0.5, 0.3],   # config 0: ranks 1, 1.5, 3
                         [0.6, 0.5, 0.4],   # config 1: ranks 2, 1.5, 2
                         [0.2, 0.1, 0.9]])  # config 2: ranks 3, 3, 1
    np.testing.assert_allclose(paired.mean_ranks(accuracy), [5.5 / 3, 5.5 / 3, 7 / 3])
    np.testing.assert_allclose(paired.mean_accuracy(accuracy), [1.6 / 3, 1.5 / 3, 1.2 / 3])
    np.testing.assert_allclose(paired.average_ranks([0.5, 0.9, 0.5, 0.1]), [2.5, 1, 2.5, 4])
    with pytest.raises(ValueError, match=r"\[configurations, tasks\]"):
        paired.mean_ranks(np.zeros((2, 0)))
