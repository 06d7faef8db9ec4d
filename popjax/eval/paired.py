"""Statistics for accuracy tables whose rows answer the same questions: a proportion's Wilson
interval, McNemar's exact test and Newcombe's interval for a paired difference, and the mean
rank / mean accuracy of configurations over tasks. Plain Python and NumPy.

Why paired: two methods scored on the same n questions disagree on only some of them. Their
accuracies' difference is (c - b) / n, where b counts the questions only the first gets right
and c those only the second gets right; the questions both get right or wrong say nothing about
which is better. McNemar's exact test asks whether b and c differ more than a fair coin would
split b + c; Newcombe's interval bounds the difference itself, so "within a point of dense" is a
statement about an interval, not about two noisy accuracies.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``mean`` over ``n`` trials (95% by default);
    (0, 1) for n = 0."""
    if n <= 0:
        return (0.0, 1.0)
    denominator = 1 + z * z / n
    centre = (mean + z * z / (2 * n)) / denominator
    half = z * math.sqrt(max(mean * (1 - mean), 0.0) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def _correct(values: Sequence[float], name: str) -> np.ndarray:
    array = np.asarray(values, np.float64)
    if array.ndim != 1 or not np.isin(array, (0.0, 1.0)).all():
        raise ValueError(f"{name} must be a 1-D sequence of 0/1 per question; got {array.ravel()[:8].tolist()}...")
    return array.astype(bool)


def discordant(first: Sequence[float], second: Sequence[float]) -> tuple[int, int]:
    """first, second [n] (1 = correct) -> (b, c): questions only ``first`` gets right, and only
    ``second``. ValueError when they are not the same questions' 0/1 grades."""
    a, b = _correct(first, "first"), _correct(second, "second")
    if a.shape != b.shape:
        raise ValueError(f"paired grades need the same questions: {a.size} vs {b.size} grades")
    return int(np.sum(a & ~b)), int(np.sum(~a & b))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: twice the binomial(b + c, 1/2) tail at min(b, c), capped
    at 1 (1 when there is no discordant pair). Exact integer sums, so large n does not underflow."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts b={b}, c={c} must be ≥ 0")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)  # int / int: correctly rounded even for huge n


def newcombe_interval(first: Sequence[float], second: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """Newcombe's (1998, method 10) score interval for acc(second) - acc(first) over the same
    questions: each accuracy's Wilson interval, combined with the phi correlation of the 2x2
    table (so agreement between the two narrows the interval)."""
    x, y = _correct(first, "first"), _correct(second, "second")
    if x.shape != y.shape or x.size == 0:
        raise ValueError(f"paired grades need the same, non-empty questions: {x.size} vs {y.size} grades")
    n = x.size
    both, only_x, only_y = int(np.sum(x & y)), int(np.sum(x & ~y)), int(np.sum(~x & y))
    neither = n - both - only_x - only_y
    p1, p2 = float(y.mean()), float(x.mean())  # the difference is p1 - p2: second minus first
    (l1, u1), (l2, u2) = wilson_interval(p1, n, z), wilson_interval(p2, n, z)
    # rows: second right / wrong; columns: first right / wrong
    a, b, c, d = both, only_y, only_x, neither
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    diff = p1 - p2
    lower = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    upper = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    return (max(-1.0, diff - math.sqrt(max(lower, 0.0))), min(1.0, diff + math.sqrt(max(upper, 0.0))))


def paired_comparison(reference: Sequence[float], other: Sequence[float]) -> dict[str, float | int]:
    """``other`` against ``reference`` on the same questions -> {"diff": acc(other) - acc(reference),
    "diff_ci": Newcombe's 95% interval, "b": only the reference right, "c": only the other right,
    "p": McNemar's exact two-sided p-value, "n"}."""
    b, c = discordant(reference, other)
    n = len(reference)
    return {"diff": (c - b) / n, "diff_ci": list(newcombe_interval(reference, other)), "b": b, "c": c,
            "p": mcnemar_exact(b, c), "n": n}


def average_ranks(values: Sequence[float]) -> np.ndarray:
    """values [m] -> ranks [m]: 1 = highest; tied values share the mean of the ranks they span."""
    values = np.asarray(values, np.float64)
    ranks = np.empty(len(values))
    for v in np.unique(values):
        where = np.flatnonzero(values == v)
        ranks[where] = 1 + np.sum(values > v) + (len(where) - 1) / 2
    return ranks


def mean_ranks(accuracy: np.ndarray) -> np.ndarray:
    """accuracy [configurations, tasks] -> the mean over tasks of each configuration's rank [configurations]
    (per task: 1 = best, ties share their mean rank)."""
    accuracy = np.asarray(accuracy, np.float64)
    if accuracy.ndim != 2 or accuracy.shape[1] == 0:
        raise ValueError(f"accuracy must be [configurations, tasks] with ≥ 1 task; got shape {accuracy.shape}")
    return np.mean([average_ranks(accuracy[:, t]) for t in range(accuracy.shape[1])], axis=0)


def mean_accuracy(accuracy: np.ndarray) -> np.ndarray:
    """accuracy [configurations, tasks] -> the unweighted mean over tasks [configurations] (every
    task counts once, whatever its number of questions, as the papers average)."""
    accuracy = np.asarray(accuracy, np.float64)
    if accuracy.ndim != 2 or accuracy.shape[1] == 0:
        raise ValueError(f"accuracy must be [configurations, tasks] with ≥ 1 task; got shape {accuracy.shape}")
    return accuracy.mean(axis=1)
