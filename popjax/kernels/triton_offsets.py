"""The 32-bit offset limit of JAX's Triton lowering, checked before a GPU kernel is built.

Pallas' Triton lowering (``jax/_src/pallas/triton/lowering.py``, ``_compute_offsets_from_indices``,
the same in jax 0.10.2 and 0.11) computes every load's and store's element offsets in 64 bits
only when the operand is larger than 2^32 *bytes*; otherwise in signed 32 bits, which Triton
sign-extends when it adds them to the pointer. An operand of 1-byte elements (int8) between
2^31 and 2^32 bytes then has element offsets past 2^31 − 1 that wrap negative: the kernel reads
the wrong memory, silently. (A 2-byte or wider operand of at most 2^32 bytes has at most 2^31
elements, so its offsets fit.) Casting the ids to int64 first does not help: the lowering
casts every index to the offset type it chose, truncating. At Llama-3.1-8B the stacked int8 rows
of every layer (CATS' up/down rows, TEAL's input-major gate/up rows: 3.76 GB each) fall in that
window; one layer's rows (117 MB) and any bf16 operand do not.

`check_offsets` refuses such an operand in one line, at trace time: ``kernel="auto"`` then runs
that call through XLA (`fallback`: a kernel that does not build), ``"pallas"`` reports it. The
remedy that keeps the kernel is to store such a stack in groups of layers under 2^31 bytes each
(docs/kernels.md, "32-bit offsets").
"""

from __future__ import annotations

import math

import jax.numpy as jnp

OFFSETS_64_ABOVE_BYTES = 2**32  # the lowering's rule: 64-bit offsets for operands of more bytes than this
I32_MAX = 2**31 - 1  # the largest element offset a signed 32-bit offset holds


def offsets_overflow(shape: tuple[int, ...], dtype) -> bool:
    """Whether a Triton kernel operand of ``shape`` and ``dtype`` gets 32-bit offsets from the
    lowering while its last element's offset (elements − 1) exceeds 2^31 − 1."""
    elements = math.prod(shape)
    return elements * jnp.dtype(dtype).itemsize <= OFFSETS_64_ABOVE_BYTES and elements - 1 > I32_MAX


def check_offsets(kernel: str, **operands) -> None:
    """ValueError naming the first operand (by keyword) of ``kernel`` whose offsets would
    overflow 32 bits (`offsets_overflow`), with its shape, dtype and bytes."""
    for name, array in operands.items():
        if array is not None and offsets_overflow(tuple(array.shape), array.dtype):
            elements = math.prod(array.shape)
            nbytes = elements * jnp.dtype(array.dtype).itemsize
            raise ValueError(
                f"the Triton kernel {kernel} would address {name} {tuple(array.shape)} {jnp.dtype(array.dtype).name} "
                f"({nbytes / 2**30:.2f} GiB, {elements} elements) with 32-bit offsets, which wrap past 2^31 elements "
                "(JAX's Triton lowering widens them only above 2^32 bytes); give it rows of at most 2^31 elements "
                "(one layer's rows, or a stack in groups of layers), or use kernel='xla'")
