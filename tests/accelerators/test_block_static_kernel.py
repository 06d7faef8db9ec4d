"""Block static selection through the fused block kernel (`kernels.decode_ffn.block_ffn` over a
block slab of the model's FFN, popjax/methods/static.py): a stacked slab read at a layer equals
that layer's own slab (TPU interpret mode and the GPU kernel in interpret mode, float and int8,
repeated and out-of-range ids); per-row blocks are each row's own FFN (also past the kernels'
64-row batch); ``kernel="pallas"`` equals ``"xla"`` in greedy tokens and log-probs on the tiny
models, in the model's channel order and in a calibrated one; Mosaic compiles its decode step for
a TPU, one call per layer."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax.kernels import block_slab, decode_ffn, ffn_gpu, ffn_tpu
from popjax.kernels.int8 import quantize
from tests.accelerators.kernel_paths import check_method_kernel
from tests.accelerators.targets import MOSAIC_CALL, SHAPES, config

# Runs Pallas kernels in interpret mode and compiles for a TPU: the full suite checks these, the quick loop does not.
pytestmark = pytest.mark.slow

S, F, D, BLOCK, LAYER = 3, 64, 40, 8, 2


def _slabs(int8: bool, seed: int = 0):
    """S layers' FFN weights -> (their stacked slab, LAYER's own slab)."""
    rng = np.random.default_rng(seed)
    gate_up, down = rng.normal(size=(S, 2, F, D)).astype(np.float32), rng.normal(size=(S, D, F)).astype(np.float32)
    if not int8:
        return block_slab.stacked_block_layout(jnp.asarray(gate_up), jnp.asarray(down), BLOCK), \
            block_slab.block_layout(jnp.asarray(gate_up[LAYER]), jnp.asarray(down[LAYER]), BLOCK)
    (q_gu, s_gu), (q_d, s_d) = quantize(gate_up), quantize(down)  # per-output-channel scales [S, 2, F, 1], [S, D, 1]
    args = [jnp.asarray(a) for a in (q_gu, q_d)]
    scales = [jnp.asarray(a) for a in (s_gu, s_d)]
    return block_slab.stacked_block_layout(*args, BLOCK, *scales), \
        block_slab.block_layout(args[0][LAYER], args[1][LAYER], BLOCK, scales[0][LAYER], scales[1][LAYER])


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_a_stacked_slab_read_at_a_layer_is_that_layers_own(platform, int8):
    stacked, own = _slabs(int8)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, D)), jnp.float32)
    ids = jnp.asarray([5, 5, 0, 9, 3], jnp.int32)  # a repeat (counted once) and one out of range (nothing)
    row_mask = jnp.asarray(np.random.default_rng(2).random((2, F // BLOCK)) < 0.6)
    kernel = ffn_tpu.block_ffn if platform == "tpu" else ffn_gpu.block_ffn
    for mask in (None, row_mask):
        got = kernel(x, stacked, ids, mask, count=4, layer=jnp.int32(LAYER), interpret=True)
        want = kernel(x, own, ids, mask, count=4, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("batch", [3, 66])
def test_per_row_blocks_are_each_rows_own_ffn(batch):
    """Rows' own blocks [B, k] are served as their union with a per-row mask; past the kernels'
    64 rows a batch runs as calls of 64 (each its own union)."""
    stacked, own = _slabs(False)
    rng = np.random.default_rng(batch)
    x = jnp.asarray(rng.normal(size=(batch, D)), jnp.float32)
    blocks = jnp.asarray(np.stack([rng.permutation(F // BLOCK)[:3] for _ in range(batch)]), jnp.int32)
    got = decode_ffn.block_ffn(x, stacked, blocks, layer=LAYER, act="silu", kernel="pallas-interpret")
    for r in (0, 1, batch - 1):
        want = ffn_tpu.block_ffn(x[r : r + 1], own, blocks[r], interpret=True)  # its blocks in its own order
        np.testing.assert_allclose(np.asarray(got[r]), np.asarray(want[0]), rtol=1e-5, atol=1e-4)


def test_a_stack_without_a_layer_is_one_line():
    stacked, own = _slabs(False)
    x = jnp.ones((1, D), jnp.float32)
    with pytest.raises(ValueError, match=r"a stack \[S, nb, 3, b, d\] is read at a layer"):
        ffn_tpu.block_ffn(x, stacked, jnp.asarray([0], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"one slab \[nb, 3, b, d\] without one"):
        ffn_tpu.block_ffn(x, own, jnp.asarray([0], jnp.int32), layer=0, interpret=True)


@pytest.fixture(scope="module")
def llama_int8(tiny_checkpoints):
    """The tiny LLaMA with int8 weights and float activations (the kernels' int8 form)."""
    directory, _ = tiny_checkpoints("llama-gqa")
    return popjax.load(directory, cache=False, weights="int8", activations="float")


@pytest.mark.parametrize("family, aggregate, layout, order", [
    ("llama", "per_sequence", "unrolled", "model"), ("llama", "shared", "scanned", "model"),
    ("llama_int8", "per_sequence", "scanned", "calibrated"), ("gemma3", "per_sequence", "unrolled", "model"),
    ("llama", "per_sequence", "scanned", "calibrated"),
])
def test_pallas_equals_xla(request, tiny_model, family, aggregate, layout, order):
    """`kernel_paths.check_method_kernel` (a batch of 2 prompts): the kernel path reads the kept
    blocks from the model's slab (per sequence: the rows' union; a calibrated order: the slab laid
    out in it), XLA a prefill copy of them."""
    from tests.reference.corpus import tiny_corpus

    model = tiny_model if family == "llama" else request.getfixturevalue(family)
    method = popjax.Static(ratio=0.4, block=8, aggregate=aggregate, kernel="xla", block_order=order)
    check_method_kernel(model, method.calibrate(model, tiny_corpus(), cache=False) if order == "calibrated" else method, layout)


@pytest.mark.parametrize("batch, spec, kernel_name", [(1, "static:block=32", "block_ffn"),
                                                      (2, "static:block=32:block_order=calibrated", "block_ffn"),
                                                      (2, "dynamic:block=32:block_order=calibrated", "block_matvec")])
def test_mosaic_compiles_the_decode_step(tmp_path, batch, spec, kernel_name):
    """Bound for a TPU, "auto" is the Mosaic kernel: one `block_ffn` call per layer, per sequence
    too (the rows' union), also over a calibrated order's slab (a placeholder order,
    `analysis.shape_fitted`), and the step holds no per-sequence copy of the weights; block
    dynamic selection in a calibrated order reads its down copy's blocks (`block_matvec`)."""
    from popjax.analysis.tpu_compile import tpu_compile

    cfg = config()
    shapes = dict(SHAPES, batch=batch)
    report = tpu_compile(cfg, "v5e:1x1", [spec], [0.4], with_dense=False, prefill=False, hlo_dir=tmp_path, **shapes)
    (record,) = report["records"]
    assert record["kernel"] == "pallas-tpu" and record["arguments"]["method_state"] < 4096  # block ids only
    (path,) = tmp_path.glob("*-0.4.step.hlo.txt")
    step = path.read_text()
    assert step.count(MOSAIC_CALL) == cfg.num_hidden_layers and kernel_name in step
