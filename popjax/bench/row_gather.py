"""The row-gather microbenchmark of ``popjax device-check``: what one weight row costs a kernel.

Whether the channel kernels (one row per selected channel) or the block kernels (b rows per
fetch) are the fast path depends on the cost of fetching a row apart from its bytes: a DMA's
issue cost on a TPU, a launch's and an indexed load's on a GPU. Neither is known until a device
measures it, so this times the project's own input-gather kernel (``gather_matvec``: y = Σ_p
x[ids_p] · W[ids_p], a row of W per id, read through `kernels.choose("pallas")` on this
platform) over a grid of row sizes (2–32 KiB), rows per call (1k–1M) and, on a TPU, rows in
flight per pipeline step (the kernel's ``chunk``; the Triton kernel's loads have no such knob),
and fits per row size and depth t = a + b·rows by least squares: a is the per-call cost, b the
per-row cost, row_bytes / b the bandwidth a long call reaches.

The rows come from a table of at most ``table_bytes`` (1 GiB on a device: past any cache), ids
striding through it by a prime so no id repeats its predecessor (a repeat is fetched once).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels import choose, ffn_gpu, matvec_tpu
from ..kernels.ffn_layout import InputRows, channel_lines
from .suites import median_seconds

STRIDE = 7919  # a prime: ids (i · STRIDE) mod rows never repeat their predecessor for a table of 2^k rows


@dataclasses.dataclass(frozen=True)
class GatherGrid:
    """The measurements: each row size (bytes; a multiple of 1024 elements of ``dtype``) × rows
    per call × depth, ``repeats`` timed calls each after a warm-up."""

    row_bytes: tuple[int, ...] = (2048, 8192, 32768)
    rows: tuple[int, ...] = (1024, 4096, 16384, 65536, 262144, 1048576)
    depths: tuple[int, ...] = (16, 64, 256)  # a TPU kernel's rows per pipeline step; one value elsewhere
    table_bytes: int = 2**30
    dtype: str = "bfloat16"
    repeats: int = 5

    def __post_init__(self) -> None:
        per = 1024 * jnp.dtype(self.dtype).itemsize
        bad = [b for b in self.row_bytes if b <= 0 or b % per]
        if bad:
            raise ValueError(f"row_bytes {bad[0]} is not a multiple of {per} (1024 {self.dtype} values: whole 8x128 tiles)")


def _gather_fn(resolved: str, n: int, depth: int) -> Callable:
    """The kernel ``resolved`` names as f(x [1, k], rows, ids [m]) -> y [1, n]."""
    if resolved == "pallas-gpu":
        return jax.jit(functools.partial(ffn_gpu.gather_matvec, out_features=n))
    return jax.jit(functools.partial(matvec_tpu.gather_matvec, out_features=n, chunk=depth,
                                     interpret=resolved == "pallas-interpret"))


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())  # compile and warm
    return median_seconds(fn, repeats)


def fit_line(rows: list[int], seconds: list[float]) -> dict[str, float] | None:
    """Least squares t = a + b·rows -> {per_call_s: a, per_row_s: b, r2}; None below 2 points."""
    if len(set(rows)) < 2:
        return None
    A = np.stack([np.ones(len(rows)), np.asarray(rows, np.float64)], axis=1)
    t = np.asarray(seconds, np.float64)
    (a, b), *_ = np.linalg.lstsq(A, t, rcond=None)
    resid = t - A @ np.array([a, b])
    total = float(np.sum((t - t.mean()) ** 2))
    return {"per_call_s": float(a), "per_row_s": float(b), "r2": 1.0 - float(np.sum(resid**2)) / total if total > 0 else 1.0}


def run_row_gather(grid: GatherGrid, out_of_time: Callable[[], bool], record: Callable[[dict], None]) -> dict[str, Any]:
    """Times every point of ``grid`` until ``out_of_time()``, calling ``record(result so far)``
    after each, and returns the result: ``points`` (row_bytes, rows, depth, seconds, GB/s of the
    rows' bytes) and ``fits`` per (row_bytes, depth)."""
    resolved = choose("pallas")
    depths = grid.depths if resolved != "pallas-gpu" else (None,)
    itemsize = jnp.dtype(grid.dtype).itemsize
    result: dict[str, Any] = {"kernel": resolved, "dtype": grid.dtype, "grid": dataclasses.asdict(grid), "points": [], "fits": [],
                              "complete": False, "note": "rows' bytes only (x, ids and y are < 1% at these sizes); GB/s = rows · row_bytes / median seconds"}
    for row_bytes in grid.row_bytes:
        n = row_bytes // itemsize
        k = max(2, min(max(grid.rows), grid.table_bytes // row_bytes))
        table = InputRows(jnp.ones((k, channel_lines(n), 128), grid.dtype))
        x = jnp.ones((1, k), grid.dtype)
        for depth in depths:
            fn = _gather_fn(resolved, n, depth or 0)
            for m in grid.rows:
                if out_of_time():
                    record(result)
                    return result
                ids = jnp.asarray((np.arange(m, dtype=np.int64) * STRIDE) % k, jnp.int32)
                seconds = _median_s(lambda: fn(x, table, ids), grid.repeats)
                result["points"].append({"row_bytes": row_bytes, "rows": m, "depth": depth, "table_rows": k, "seconds": seconds,
                                         "gb_s": m * row_bytes / seconds / 1e9})
                record(result)
            del fn
        del table
    result["complete"] = True
    record(result)
    return result


def add_fits(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``fits``: per (row_bytes, depth), t = a + b·rows over its points."""
    groups: dict[tuple, list[dict]] = {}
    for p in result["points"]:
        groups.setdefault((p["row_bytes"], p["depth"]), []).append(p)
    fits = []
    for (row_bytes, depth), points in groups.items():
        fit = fit_line([p["rows"] for p in points], [p["seconds"] for p in points])
        if fit is not None:
            per_row = fit["per_row_s"]
            fits.append({"row_bytes": row_bytes, "depth": depth, "points": len(points), **fit,
                         "long_call_gb_s": row_bytes / per_row / 1e9 if per_row > 0 else None})
    return {**result, "fits": fits}
