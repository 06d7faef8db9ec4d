"""The decode-FFN kernel a resolved ``kernel`` names (`popjax.kernels.choose`, `RESOLVED`):
what a method's plan calls, so that the plan names no platform.

"pallas-tpu" runs the Mosaic kernels (`matvec_tpu`), "pallas-interpret" the same kernels in
Pallas' interpret mode (a CPU), "pallas-gpu" the Triton ones (`ffn_gpu`).
"""

from __future__ import annotations

import jax

from . import RESOLVED, ffn_gpu, matvec_tpu
from .ffn_layout import InputRows


def gather_matvec(x: jax.Array, rows: InputRows, ids: jax.Array, *, out_features: int, kernel: str) -> jax.Array:
    """y [B, n] = W · x over x's inputs ``ids`` ([m] or [B, m]; `ffn_layout`'s selection
    contract) with W as `ffn_layout.InputRows` [k, L, 128], x [B, k], by the Pallas ``kernel``
    (one of `RESOLVED` but "xla"); ValueError naming any other value."""
    if kernel == "pallas-gpu":
        return ffn_gpu.gather_matvec(x, rows, ids, out_features=out_features)
    if kernel in ("pallas-tpu", "pallas-interpret"):
        return matvec_tpu.gather_matvec(x, rows, ids, out_features=out_features, interpret=kernel == "pallas-interpret")
    raise ValueError(f"kernel={kernel!r} is not a Pallas kernel; use one of {RESOLVED[1:]}")
