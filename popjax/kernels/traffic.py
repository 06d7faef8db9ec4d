"""The HBM bytes each decode-FFN kernel moves per call, counted from its BlockSpecs and DMAs
(what `ffn_tpu` and `matvec_tpu` pass to the TPU compiler as a call's cost estimate, and what the
TPU simulator checks in tests/accelerators/test_kernels_compile.py), and the dense and ideal
bytes they are compared with (docs/kernels.md, "Bytes per decode step, per FFN call")."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .ffn_layout import channel_lines


def _size(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def dense_ffn_bytes(d: int, f: int, batch: int, weight_dtype, x_dtype) -> int:
    """Bytes a dense FFN must move: all 3·f·d weights (+ int8 scales), x in and y out."""
    scales = (2 * f + d) * 4 if jnp.dtype(weight_dtype) == jnp.int8 else 0
    return 3 * f * d * _size(weight_dtype) + scales + 2 * batch * d * _size(x_dtype)


def ideal_ffn_bytes(kept: int, d: int, batch: int, weight_dtype, x_dtype) -> int:
    """Bytes of exactly ``kept`` channels' weights (+ their scales), x in and y out."""
    scales = (2 * kept + d) * 4 if jnp.dtype(weight_dtype) == jnp.int8 else 0
    return 3 * kept * d * _size(weight_dtype) + scales + 2 * batch * d * _size(x_dtype)


def block_ffn_bytes(blocks_read: int, positions: int, block_size: int, d: int, batch: int, weight_dtype, x_dtype, masked: bool) -> int:
    """HBM bytes of the TPU block kernel: ``blocks_read`` slabs fetched (a block repeated at the
    next position is not fetched again) over ``positions`` grid steps, their int8 scales, the
    per-position row masks, the id and keep scalars, x once and y once."""
    int8 = jnp.dtype(weight_dtype) == jnp.int8
    per_block = 3 * block_size * d * _size(weight_dtype) + (2 * block_size * 4 if int8 else 0)
    other = (d * 4 if int8 else 0) + (positions * batch * 4 if masked else 0) + 2 * positions * 4
    return blocks_read * per_block + other + 2 * batch * d * _size(x_dtype)


def gather_ffn_bytes(rows_read: int, positions: int, chunk: int, d: int, batch: int, weight_dtype, x_dtype,
                     matrices: int = 3) -> int:
    """HBM bytes of the TPU channel kernel: ``rows_read`` channels' ``matrices`` rows of L·128
    (3: gate, up, down; 2 when the gate values are given: up, down; one DMA each), per-position
    masks and the ``matrices`` − 1 int8 scales over ``positions`` padded to the chunk, the
    scalars, x in and y out (both L·128 wide)."""
    int8 = jnp.dtype(weight_dtype) == jnp.int8
    width = channel_lines(d) * 128
    padded = -(-positions // chunk) * chunk
    other = padded * batch * 4 + (padded * (matrices - 1) * 4 + width * 4 if int8 else 0) + 2 * padded * 4
    return rows_read * matrices * width * _size(weight_dtype) + other + 2 * batch * width * _size(x_dtype)


def gather_matvec_bytes(rows_read: int, positions: int, chunk: int, n: int, batch: int, weight_dtype, x_dtype) -> int:
    """HBM bytes of the TPU input-gather matvec: ``rows_read`` input rows of L·128 (one DMA
    each), x's values at the positions (padded to the chunk), the scalars, int8 scales, y."""
    width = channel_lines(n) * 128
    padded = -(-positions // chunk) * chunk
    scales = width * 4 if jnp.dtype(weight_dtype) == jnp.int8 else 0
    other = padded * batch * _size(x_dtype) + 2 * padded * 4 + scales + batch * width * _size(x_dtype)
    return rows_read * width * _size(weight_dtype) + other


def gather_row_dots_bytes(rows_read: int, positions: int, chunk: int, d: int, batch: int, weight_dtype, x_dtype,
                          n_rows: int = 0) -> int:
    """HBM bytes of the TPU row-dot kernel: ``rows_read`` rows of L·128 (one DMA each), x once
    (L·128 wide), the f32 outputs and the scalars over ``positions`` padded to the chunk, and
    for int8 the scales of all ``n_rows`` rows (prefetched whole into SMEM)."""
    width = channel_lines(d) * 128
    padded = -(-positions // chunk) * chunk
    scales = n_rows * 4 if jnp.dtype(weight_dtype) == jnp.int8 else 0
    return rows_read * width * _size(weight_dtype) + batch * width * _size(x_dtype) + padded * (batch + 2) * 4 + scales


def block_matvec_bytes(blocks_read: int, positions: int, block: int, n: int, batch: int, weight_dtype, x_dtype) -> int:
    """HBM bytes of the TPU block matvec: ``blocks_read`` blocks of b input rows of L·128 (a
    block repeated at the next position is not fetched again), x's values at the ``positions``
    blocks, the ids, int8 scales once, y once."""
    width = channel_lines(n) * 128
    scales = width * 4 if jnp.dtype(weight_dtype) == jnp.int8 else 0
    other = positions * block * batch * _size(x_dtype) + positions * 4 + scales + batch * width * _size(x_dtype)
    return blocks_read * block * width * _size(weight_dtype) + other


def count_distinct_fetches(ids: np.ndarray) -> int:
    """How many fetches a BlockSpec pipeline makes for fetch ids [n]: one per change of id."""
    ids = np.asarray(ids)
    return int(1 + np.count_nonzero(ids[1:] != ids[:-1])) if ids.size else 0
