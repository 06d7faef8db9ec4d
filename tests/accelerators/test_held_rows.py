"""Kernel rows held in their stack (`popjax.kernels.held_rows`): a scanned model's decode step
hands a method's state rows whole, with their layer, and each kernel reads that layer by offset.

The kernels read held rows as they read the layer's own rows (TPU interpret mode and the GPU
kernels in interpret mode, float and int8); the scanned POP step passes C's candidate rows to the
layer scan as a constant, not as a per-layer slice (which XLA:TPU copied out for the Pallas call
in every layer); a step that rewrites held rows is refused in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import popjax
from popjax import engine
from popjax.kernels import ffn_gpu, held_rows, matvec_tpu
from popjax.kernels.ffn_layout import InputRows, OutputRows, channel_lines, input_layout, output_layout
from popjax.kernels.int8 import quantize
from popjax.loaded import with_scanned_layers

# Runs Pallas kernels in interpret mode: the full suite checks these, the quick loop does not.
pytestmark = pytest.mark.slow

S, K, N, B = 3, 24, 40, 2  # layers in the stack, rows per layer, outputs per row, batch
LAYER = 1


def _stack(kind: str, int8: bool, seed: int = 0):
    """S layers' rows of one kind -> (held rows at LAYER, that layer's own rows)."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(S):
        w = rng.normal(size=(N, K) if kind == "input" else (K, N)).astype(np.float32)
        values, scale = quantize(w) if int8 else (w, None)
        layout = input_layout if kind == "input" else output_layout
        layers.append(layout(jnp.asarray(values), None if scale is None else jnp.asarray(scale)))
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    return stacked._replace(layer=jnp.int32(LAYER)), layers[LAYER]


KERNELS = {
    "gather_matvec": {
        "tpu": lambda x, rows, ids: matvec_tpu.gather_matvec(x, rows, ids, out_features=N, chunk=4, interpret=True),
        "gpu": lambda x, rows, ids: ffn_gpu.gather_matvec(x, rows, ids, out_features=N, interpret=True),
    },
    "values_matvec": {
        "tpu": lambda v, rows, ids: matvec_tpu.values_matvec(v, rows, ids, out_features=N, chunk=4, interpret=True),
        "gpu": lambda v, rows, ids: ffn_gpu.values_matvec(v, rows, ids, out_features=N, interpret=True),
    },
    "block_matvec": {
        "tpu": lambda x, rows, ids: matvec_tpu.block_matvec(x, rows, ids, block=4, out_features=N, interpret=True),
    },
}


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("name, platform", [(n, p) for n, ps in KERNELS.items() for p in ps])
def test_input_row_kernels_read_held_rows_as_the_layers_own(name, platform, int8):
    """Ids with a repeat and one out of range: the held stack gives the layer's own result."""
    held, own = _stack("input", int8)
    rng = np.random.default_rng(1)
    ids = jnp.asarray([3, 3, 0, 17, K + 5, 9] if name != "block_matvec" else [2, 0, 2, 7], jnp.int32)
    x = jnp.asarray(rng.normal(size=(B, ids.shape[0] if name == "values_matvec" else K)).astype(np.float32))
    call = KERNELS[name][platform]
    np.testing.assert_allclose(np.asarray(call(x, held, ids)), np.asarray(call(x, own, ids)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_row_dots_read_held_rows_as_the_layers_own(platform, int8):
    """The int8 rows' scales are the layer's own (read in SMEM by the rows' ids within the layer)."""
    held, own = _stack("output", int8)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, N)).astype(np.float32))
    ids = jnp.asarray([5, 0, 0, 23, K + 1, 11], jnp.int32)
    if platform == "tpu":
        call = lambda rows: matvec_tpu.gather_row_dots(x, rows, ids, chunk=4, interpret=True)  # noqa: E731
    else:
        call = lambda rows: ffn_gpu.gather_row_dots(x, rows, ids, interpret=True)  # noqa: E731
    np.testing.assert_allclose(np.asarray(call(held)), np.asarray(call(own)), atol=1e-5, rtol=1e-5)


def test_per_row_and_row_of():
    """`per_row` flattens a per-sequence stack [S, B, ...] (a bitcast) and gives each row its
    offset, layer·B + row (what a vmap over rows maps, the stack unmapped): a kernel reads there
    that row's own rows; `row_of` a row of it keeps the rows held."""
    held, _ = _stack("input", True)
    per_seq = held._replace(values=jnp.stack([held.values, held.values + 1], 1), scale=jnp.stack([held.scale, held.scale], 1))
    flat = held_rows.per_row(per_seq, 2)
    assert flat.values.shape == (2 * S, *held.values.shape[1:]) and np.asarray(flat.layer).tolist() == [2 * LAYER, 2 * LAYER + 1]
    x, ids = jnp.ones((1, K), jnp.float32), jnp.arange(K, dtype=jnp.int32)
    read = lambda rows: matvec_tpu.gather_matvec(x, rows, ids, out_features=N, chunk=4, interpret=True)  # noqa: E731
    for r in range(2):
        own = InputRows(per_seq.values[LAYER, r], per_seq.scale[LAYER, r])
        np.testing.assert_array_equal(np.asarray(read(flat._replace(layer=flat.layer[r]))), np.asarray(read(own)))
    assert held_rows.row_axes(flat) == InputRows(None, None, 0)
    row = held_rows.row_of(per_seq)
    assert held_rows.held_rows(row) and row.values.shape == held.values.shape


def test_a_step_that_rewrites_held_rows_is_refused():
    rows = InputRows(jnp.zeros((S, K, channel_lines(N), 128)))
    held = held_rows.hold({"rows": rows, "count": jnp.zeros((S,))})
    given = held_rows.layer_state(held, [jnp.float32(0)] + [None] * (len(held.rows) - 1), jnp.int32(LAYER))
    given_rows = next(n for n in jax.tree_util.tree_leaves(given, is_leaf=held_rows.is_rows) if held_rows.is_rows(n))
    assert held_rows.held_rows(given_rows)
    kept = held_rows.release(held, given, given)
    assert kept.count(None) == 1
    rewritten = jax.tree_util.tree_map(lambda n: n._replace(values=n.values + 1) if held_rows.is_rows(n) else n, given,
                                       is_leaf=held_rows.is_rows)
    with pytest.raises(ValueError, match="rewrote kernel rows of its method state.*use the unrolled model"):
        held_rows.release(held, rewritten, given)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_scanned_step_passes_the_candidate_rows_to_the_layer_scan_whole(tiny_model, batch):
    """POP with its kernel on the scanned tiny LLaMA: C's rows [L, B, n_C, L', 128] enter the
    decode step's layer scan as a constant (each layer's kernel reads its rows by offset), not as
    a scanned input that the scan slices per layer (a copy for the Pallas call)."""
    model = with_scanned_layers(tiny_model)
    plan = popjax.POP(ratio=0.4, gamma=0.2, kernel="pallas").bind(model.config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 100, size=(batch, 5)), jnp.int32)
    state = engine._prefill(nnx.merge(model.graphdef, model.params), plan, tokens, jnp.ones_like(tokens), 8)[1]
    rows = state.method_states["down_candidates"]
    assert isinstance(rows, InputRows) and rows.values.shape[:2] == (model.config.num_hidden_layers, batch)

    def step(params, state):
        return engine._advance(nnx.merge(model.graphdef, params), plan, state, tokens[:, -1])[1].method_states

    jaxpr = jax.make_jaxpr(step)(model.params, state).jaxpr
    layer_scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan" and "pallas_call" in str(e.params["jaxpr"]))
    consts = layer_scan.invars[: layer_scan.params["num_consts"]]
    xs = layer_scan.invars[layer_scan.params["num_consts"] + layer_scan.params["num_carry"]:]
    shape = tuple(rows.values.shape)
    assert any(tuple(v.aval.shape) == shape for v in consts)
    assert not any(tuple(v.aval.shape) == shape for v in xs)
    # inside the layer the kernel reads the whole stack as rows [L·B·n_C, L', 128] (a bitcast; per row at its
    # own offset under the vmap over rows at batch 2), not a copy of the layer's or the row's rows
    flat = (shape[0] * shape[1] * shape[2], *shape[3:])
    calls = [e for e in _equations(layer_scan.params["jaxpr"].jaxpr) if e.primitive.name == "pallas_call"]
    assert calls and all(any(tuple(v.aval.shape) == flat for v in e.invars) for e in calls), [
        [tuple(v.aval.shape) for v in e.invars] for e in calls]
    new = jax.jit(step)(model.params, state)["down_candidates"]
    assert isinstance(new, InputRows) and new.layer is None and np.array_equal(np.asarray(new.values), np.asarray(rows.values))


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _equations(inner if hasattr(inner, "eqns") else inner.jaxpr)
