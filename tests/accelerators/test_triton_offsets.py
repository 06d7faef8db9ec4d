"""The Triton 32-bit offset limit at its threshold (popjax/kernels/triton_offsets.py): lowered for
CUDA on abstract operands (nothing is allocated), the Triton IR read as the lowering emits it."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import pallas_call_registration as registration
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from popjax.kernels import ffn_gpu, triton_offsets
from popjax.kernels.ffn_layout import InputRows

S = jax.ShapeDtypeStruct
ROW = 16384  # elements per row: 128 lines of 128 (a Llama-3.1-8B gate/up input row is 28672)
AT_LIMIT = 2**31 // ROW  # rows of int8 whose last element's offset is 2^31 - 1


@contextlib.contextmanager
def triton_ir():
    """The Triton modules (MLIR text) of every pallas_call lowered within the block."""
    modules, lower = [], registration.lowering.lower_jaxpr_to_triton_module

    def recorded(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    registration.lowering.lower_jaxpr_to_triton_module = recorded
    try:
        yield modules
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def offset_types(module: str) -> set[str]:
    """The element types of the offsets ``tt.addptr`` adds to pointers (i32 or i64)."""
    return set(re.findall(r"tt\.addptr .*?: .*?, tensor<[0-9x]+x(i\d+)>", module))


def lower_gather(rows: int, dtype: str = "int8"):
    """`ffn_gpu.gather_matvec` (one Triton kernel) over int8 input rows [rows, 128, 128] for CUDA."""
    table = InputRows(S((rows, ROW // 128, 128), dtype), S((1, ROW), "float32") if dtype == "int8" else None)
    fn = lambda x, t, i: ffn_gpu.gather_matvec(x, t, i, out_features=ROW)  # noqa: E731
    with triton_ir() as modules:
        jax.jit(fn).trace(S((1, rows), "bfloat16"), table, S((64,), "int32")).lower(lowering_platforms=("cuda",))
    return modules


def test_the_lowering_uses_32_bit_offsets_up_to_4_gib():
    """The premise: a raw Pallas Triton kernel over a 3 GiB int8 operand gets i32 offsets (so
    rows past 2^31 elements wrap), and one over 4 GiB + 1 row gets i64. If JAX widens earlier,
    this fails, and `triton_offsets` can be relaxed."""
    def kernel(w_ref, i_ref, o_ref):
        o_ref[...] = w_ref[i_ref[...], :].astype(jnp.float32)

    def lowered(rows):
        # Triton's compiler params choose the Triton backend (Mosaic GPU is pallas_call's default on a GPU)
        call = pl.pallas_call(kernel, out_shape=S((16, ROW), jnp.float32), compiler_params=plgpu.CompilerParams())
        with triton_ir() as modules:
            jax.jit(call).trace(S((rows, ROW), "int8"), S((16,), "int32")).lower(lowering_platforms=("cuda",))
        return offset_types(modules[0])

    assert lowered(3 * 2**30 // ROW) == {"i32"}
    assert "i64" in lowered(2**32 // ROW + 1)


def test_gather_lowers_at_the_limit_with_32_bit_offsets():
    """2^31 elements of int8 exactly: the last offset is 2^31 - 1, the i32 offsets hold it."""
    assert not triton_offsets.offsets_overflow((AT_LIMIT, ROW // 128, 128), "int8")
    modules = lower_gather(AT_LIMIT)
    assert len(modules) == 1 and offset_types(modules[0]) == {"i32"}


def test_gather_refuses_one_row_past_the_limit():
    with pytest.raises(ValueError, match=r"input_rows would address weights \(131073, 16384\) int8 .*32-bit offsets"):
        lower_gather(AT_LIMIT + 1)


def test_gather_lowers_past_4_gib_with_64_bit_offsets():
    """Past 2^32 bytes the lowering widens the offsets itself: allowed, and i64 in the IR."""
    rows = 2**32 // ROW + 8
    assert not triton_offsets.offsets_overflow((rows, ROW), "int8")
    modules = lower_gather(rows)
    assert "i64" in offset_types(modules[0])


def test_bf16_never_overflows_below_4_gib():
    """A 2-byte operand of at most 2^32 bytes has at most 2^31 elements: never refused."""
    assert not triton_offsets.offsets_overflow((2**31 // ROW, ROW), "bfloat16")
    assert not any(triton_offsets.offsets_overflow((n, ROW), "bfloat16") for n in (AT_LIMIT - 1, AT_LIMIT, AT_LIMIT + 1))
    assert triton_offsets.offsets_overflow((AT_LIMIT + 1, ROW), "int8")


def test_interpret_mode_is_not_refused():
    """Interpret mode indexes through XLA (64-bit): the check is for compiled Triton only."""
    table = InputRows(S((AT_LIMIT + 1, ROW // 128, 128), "int8"), S((1, ROW), "float32"))
    fn = lambda x, t, i: ffn_gpu.gather_matvec(x, t, i, out_features=ROW, interpret=True)  # noqa: E731
    out = jax.eval_shape(fn, S((1, AT_LIMIT + 1), "bfloat16"), table, S((64,), "int32"))
    assert out.shape == (1, ROW)
