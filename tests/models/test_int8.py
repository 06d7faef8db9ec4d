"""Weight-only int8 (popjax/kernels/int8.py; `popjax.load(..., weights="int8")`): the quantized linear
layer against NumPy, POP on int8 weights against the NumPy POP reference on the dequantized
weights, an int8 model against the float model of its dequantized weights (a MoE model, scanned layers;
every registered method in tests/methods/test_method_matrix.py), the converted store, and bad input."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import popjax
from popjax import engine
from popjax.convert import convert as conv
from popjax.convert.readers import CheckpointError
from popjax.requests import pad_batch
from popjax.loaded import with_scanned_layers
from popjax.loading import build_model
from popjax.methods import POPPlan, make_method
from popjax.models import layers
from popjax.kernels.int8 import TWO_PASS, Int8Weight, dot, quantize
from tests.reference.ffn import int8_layer, random_batch, random_layer, ref_quantize, ref_sizes
from tests.reference.matrix import dequantized_twin, ready
from tests.reference.methods import ref_pop_decode, ref_prefill

ATOL = 1e-5


def test_quantize_and_dot_match_numpy():
    """quantize = the loop reference exactly; the int8 dot (scale after the dot) = x · (q·s)ᵀ in
    float64 within fp32 rounding, for the layouts the model uses (rows, stacked gate/up, rows
    gathered then transposed); an all-zero row stays zero."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.2, (12, 16)) * rng.uniform(0.1, 3, (12, 1))
    w[3] = 0
    q, scale = quantize(w.astype(np.float32))
    q_ref, s_ref = ref_quantize(w.astype(np.float32))
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_allclose(scale[:, 0], s_ref, rtol=1e-7)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and not q[3].any()
    W = Int8Weight(jnp.asarray(q), jnp.asarray(scale))
    deq = q.astype(np.float64) * s_ref[:, None]
    np.testing.assert_allclose(np.asarray(W.dequantize()), deq, rtol=1e-6, atol=1e-7)
    x = rng.normal(size=(3, 5, 16))
    np.testing.assert_allclose(np.asarray(dot("...i,oi->...o", jnp.asarray(x, jnp.float32), W)), x @ deq.T, rtol=1e-5, atol=ATOL)
    stacked = W.reshape(2, 6, 16)  # gate/up [2, f, d]: the scale follows its rows
    got = dot("...d,gnd->g...n", jnp.asarray(x, jnp.float32), stacked)
    np.testing.assert_allclose(np.asarray(got), np.einsum("...d,gnd->g...n", x, deq.reshape(2, 6, 16)), rtol=1e-5, atol=ATOL)
    ids = jnp.asarray([7, 0, 3])
    rows = W.take(ids, axis=0).T  # [d, k]: a compact copy, transposed: the scale moves to the last axis
    assert rows.scale.shape == (1, 3)
    np.testing.assert_allclose(np.asarray(rows.dequantize()), deq[[7, 0, 3]].T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("f, n_keep, gamma", [(96, 67, 0.1), (96, 48, 0.3), (32, 20, 1.0)])
def test_pop_on_int8_weights_matches_reference_on_dequantized(f, n_keep, gamma):
    """POP's plan on int8 gate/up/down (compact copies int8 with their scales) selects exactly
    what the NumPy reference selects on the dequantized weights, outputs within 1e-5."""
    rng = np.random.default_rng(f + n_keep)
    d = 16
    layer, W = int8_layer(random_layer(rng, d, f))
    X, valid = random_batch(rng, d, [5, 8, 3], T=8)
    _, _, m = ref_sizes(f, n_keep, gamma)
    plan = POPPlan(f=f, n_keep=n_keep, m=m, aggregate="shared")
    y, state, _ = plan.prefill(layer, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    Y_ref, R, C, _ = ref_prefill(W, X, valid, n_keep, m)
    assert np.asarray(state["retained_idx"]).tolist() == R
    assert np.asarray(state["candidate_idx"]).tolist() == C
    assert isinstance(state["gate_up"], Int8Weight) and state["gate_up"].values.dtype == jnp.int8
    np.testing.assert_allclose(np.asarray(y)[valid], Y_ref[valid], atol=ATOL)
    for step in range(3):
        x_t = rng.normal(0, 1.0, (3, 1, d))
        y_t, state, aux = plan.decode(layer, state, jnp.asarray(x_t, jnp.float32), step, jnp.ones((3, 1), bool))
        y_ref, selected = ref_pop_decode(W, R, C, x_t, m)
        np.testing.assert_allclose(np.asarray(y_t), y_ref, atol=ATOL)
        if m:
            assert np.asarray(aux["selected"]).tolist() == selected


@pytest.fixture(scope="module")
def int8_pair(tiny_checkpoints):
    """(weight-only int8 model, its dequantized float twin) of the tiny llama-gqa checkpoint."""
    directory, _ = tiny_checkpoints("llama-gqa")
    model = popjax.load(directory, cache=False, weights="int8", activations="float")
    return model, dequantized_twin(model)


def test_int8_model_equals_float_model_on_dequantized_weights(int8_pair):
    """Logits of prefill and of greedy decode: int8 model = float model of q · s within 1e-5;
    every linear weight (embeddings and LM head too) is int8 with a [..., 1] fp32 scale; norms stay float."""
    model, twin = int8_pair
    leaves = dict((".".join(str(getattr(k, "key", k)) for k in path), a)
                  for path, a in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(model.params)))
    for name in ("layers.0.attn.qkv", "layers.0.attn.o", "layers.1.mlp.gate_up", "layers.1.mlp.down"):
        assert leaves[name].dtype == jnp.int8 and leaves[name + "_scale"].shape == (*leaves[name].shape[:-1], 1)
    assert leaves["lm_head"].dtype == jnp.int8 and leaves["lm_head_scale"].shape == (model.config.vocab_size, 1)
    assert leaves["embed"].dtype == jnp.int8 and leaves["layers.0.attn_norm.weight"].dtype == jnp.float32
    prompts = [[5, 17, 3, 99, 42, 7], [8, 9, 10]]
    got = popjax.forward(model, [[0, 0, 0, 8, 9, 10], prompts[0]], attention_mask=[[0, 0, 0, 1, 1, 1], [1] * 6])
    want = popjax.forward(twin, [[0, 0, 0, 8, 9, 10], prompts[0]], attention_mask=[[0, 0, 0, 1, 1, 1], [1] * 6])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=1e-5)
    a, _ = popjax.generate_ids(model, prompts, 6, ignore_eos=True)
    b, _ = popjax.generate_ids(twin, prompts, 6, ignore_eos=True)
    assert a == b


def test_int8_activation_dot_matches_numpy():
    """activations="int8": each row of x quantized to int8 with its own scale, an exact integer
    dot, both scales on the output — against NumPy in float64, for one row (padded to two
    inside), several rows and the stacked gate/up layout."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.2, (12, 16)).astype(np.float32)
    q, s = quantize(w)
    W = Int8Weight(jnp.asarray(q), jnp.asarray(s), jnp.float32, "int8")
    for shape in ((1, 1, 16), (3, 5, 16)):
        x = rng.normal(size=shape).astype(np.float32)
        x[0, 0, 3] = 0.0
        xq, sx = ref_quantize(x.reshape(-1, 16))
        want = (xq.astype(np.int64) @ q.T.astype(np.int64)) * sx[:, None] * s[:, 0][None]
        got = dot("...i,oi->...o", jnp.asarray(x), W)
        np.testing.assert_allclose(np.asarray(got).reshape(-1, 12), want, rtol=1e-6, atol=1e-6)
    x = rng.normal(size=(1, 16)).astype(np.float32)
    xq, sx = ref_quantize(x)
    got = dot("...d,gnd->g...n", jnp.asarray(x), W.reshape(2, 6, 16))
    want = ((xq.astype(np.int64) @ q.T.astype(np.int64)) * sx[:, None] * s[:, 0][None]).reshape(1, 2, 6).transpose(1, 0, 2)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_two_pass_int8_activation_dot_matches_numpy():
    """The LM head's two passes (`TWO_PASS`): x quantized per row, then what that left quantized
    per row again, each pass an exact integer dot with its own scale — against NumPy in float64,
    for one row and several (both passes share one dot); within 1e-3 of float activations."""
    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.2, (40, 16)).astype(np.float32)
    q, s = quantize(w)
    W = Int8Weight(jnp.asarray(q), jnp.asarray(s), jnp.float32, TWO_PASS)
    for shape in ((1, 1, 16), (3, 5, 16)):
        x = rng.normal(size=shape).astype(np.float32)
        x[0, 0, 5] = 30.0  # an outlier channel, as a final norm's output has
        rows = x.reshape(-1, 16)
        xq, sx = ref_quantize(rows)
        rest_q, rest_s = ref_quantize(rows - xq * sx[:, None].astype(np.float32))
        integer = lambda a: a.astype(np.int64) @ q.T.astype(np.int64)
        want = (integer(xq) * sx[:, None] + integer(rest_q) * rest_s[:, None]) * s[:, 0][None]
        got = np.asarray(dot("btd,vd->btv", jnp.asarray(x), W)).reshape(-1, 40)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        exact = rows.astype(np.float64) @ (q * s).T.astype(np.float64)
        assert np.abs(got - exact).max() < 1e-3 * np.abs(exact).max()


def test_int8_model_head_and_qkv_read_two_passes(tiny_checkpoints, monkeypatch):
    """An int8-activation model's LM head and q/k/v dots get the two-pass weight, its o dot one
    pass; weight-only models keep "float" everywhere."""
    directory, _ = tiny_checkpoints("llama-gqa")
    for activations, two, one in (("int8", TWO_PASS, "int8"), ("float", "float", "float")):
        loaded = popjax.load(directory, cache=False, weights="int8", activations=activations)
        seen = {"qkv": set(), "linear": set()}
        grouped, linear = layers._grouped_linear, layers.linear
        monkeypatch.setattr(layers, "_grouped_linear", lambda x, w, b: (seen["qkv"].add(w.activations), grouped(x, w, b))[1])
        monkeypatch.setattr(layers, "linear", lambda x, w, *a: (seen["linear"].add(w.activations), linear(x, w, *a))[1])
        popjax.forward(loaded, [[5, 17, 3]])
        monkeypatch.undo()
        model = nnx.merge(loaded.graphdef, loaded.params)
        assert model.lm_head_weight().activations == two
        assert seen == {"qkv": {two}, "linear": {one, two}}  # `linear` runs q/k/v's dot too


@pytest.mark.slow  # six methods' programs on the int8-activation model (~7 s); the take_split_rows check below stays quick
def test_int8_activations_model_stays_close(tiny_checkpoints):
    """The default int8 model on CPU (activations="int8") against the weight-only one: logits
    within the activation-quantization error; methods of every kind of compact copy run on it
    (the registry runs weight-only in tests/methods/test_method_matrix.py: the dot's two modes share every gather)."""
    directory, _ = tiny_checkpoints("llama-gqa")
    fast = popjax.load(directory, cache=False, weights="int8")
    assert fast.config.activations == "int8"  # the CPU default
    exact = popjax.load(directory, cache=False, weights="int8", activations="float")
    prompts = [[5, 17, 3, 99, 42, 7, 8, 9]]
    a, b = popjax.forward(fast, prompts), popjax.forward(exact, prompts)
    assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) < 0.05 * float(np.abs(np.asarray(b)).max())
    tokens, mask = pad_batch([[5, 17, 3, 99, 42, 7], [8, 9, 10]], 0)
    targets = jnp.asarray([[13, 14, 15], [16, 17, 18]], jnp.int32)
    for name in ("static", "pop", "dynamic", "bwap", "pop-shortlist", "wanda-sp"):
        method = ready(name, "llama", fast)
        nll, _, _ = engine.teacher_force(fast.graphdef, fast.params, method.bind(fast.config), jnp.asarray(tokens),
                                         jnp.asarray(mask), targets, data=method.data(fast))
        assert np.all(np.isfinite(np.asarray(nll))), name


def int8_state_formats(model, name: str) -> list[str]:
    """How every int8 array in a plan's state after prefill reads its activations ("int8" or
    "float"): the per-step row copies must keep their model's format."""
    plan = make_method(name).bind(model.config)
    tokens, mask = pad_batch([[5, 17, 3, 99, 42, 7], [8, 9, 10]], 0)
    _, _, states, _ = engine.prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), plan)
    leaves = jax.tree_util.tree_leaves(states, is_leaf=lambda a: isinstance(a, Int8Weight))
    return sorted({a.activations for a in leaves if isinstance(a, Int8Weight)})


def test_step_rows_keep_int8_activations(tiny_checkpoints):
    """Gate-scored and shortlisted POP copy per-step rows (`sharding.take_split_rows`) out of an
    int8 model: the copies read their activations as the model does (int8 here), not weight-only.
    The same on a mesh: tests/scale/eight_devices.py's worker."""
    directory, _ = tiny_checkpoints("llama-gqa")
    model = popjax.load(directory, cache=False, weights="int8", activations="int8")
    for name in ("pop-gate", "pop-shortlist"):
        assert int8_state_formats(model, name) == ["int8"], name


def test_int8_scanned_layers_and_moe(int8_pair):
    """The scanned int8 model equals the unrolled one; a MoE model's experts are int8 too and
    its int8 model equals its dequantized twin."""
    model, _ = int8_pair
    prompts = [[5, 17, 3, 99, 42, 7]]
    np.testing.assert_allclose(np.asarray(popjax.forward(with_scanned_layers(model), prompts)),
                               np.asarray(popjax.forward(model, prompts)), atol=ATOL)
    from popjax.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 40,
                                    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_experts": 8,
                                    "num_experts_per_tok": 2, "mlp_only_layers": [1], "max_position_embeddings": 64})
    rng = np.random.default_rng(0)
    tree = conv.unflatten({k: rng.normal(0, 0.3, s).astype(np.float32) for k, s in conv.checkpoint_shapes(cfg).items()})
    moe = build_model(dataclasses.replace(cfg, weights="int8"), tree, None, "moe", "float32")
    experts = nnx.to_pure_dict(moe.params)["layers"][0]["mlp"]["experts"]
    assert experts["gate_up"].dtype == jnp.int8 and experts["down_scale"].shape == (8, 32, 1)
    twin = dequantized_twin(moe)
    for method in (popjax.Dense(), popjax.POP(0.3)):
        np.testing.assert_allclose(np.asarray(popjax.forward(moe, [[5, 6, 7, 8, 9]], method=method)),
                                   np.asarray(popjax.forward(twin, [[5, 6, 7, 8, 9]], method=method)), atol=1e-4)


def test_store_round_trip_is_bit_exact_and_keyed_by_format(tiny_checkpoints, tmp_path):
    """A converted int8 store holds int8 arrays and scales (loading it gives the in-memory
    conversion's arrays bit for bit); its config says int8; the cache keys float and int8 apart."""
    directory, _ = tiny_checkpoints("llama-gqa")
    store = popjax.convert_source(directory, tmp_path / "int8", weights="int8")
    assert json.loads((store / "config.json").read_text())["popjax_weights"] == "int8"
    loaded = popjax.load(store)
    direct = popjax.load(directory, cache=False, weights="int8")
    assert loaded.config.weights == "int8"
    for a, b in zip(jax.tree_util.tree_leaves(nnx.to_pure_dict(loaded.params)), jax.tree_util.tree_leaves(nnx.to_pure_dict(direct.params))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cached_int8 = popjax.load(directory, weights="int8")
    cached_float = popjax.load(directory)
    assert cached_int8.config.weights == "int8" and cached_float.config.weights == "float"
    from popjax.cache import list_entries

    keys = [e.key_fields for e in list_entries() if e.kind == "converted"]
    assert any(k.get("weights") == "int8" for k in keys) and any("weights" not in k for k in keys)


def test_bad_weight_formats_are_one_clear_line(tiny_checkpoints, tmp_path, monkeypatch):
    directory, _ = tiny_checkpoints("llama-gqa")
    with pytest.raises(ValueError, match=r"weights='int4' is not a supported weight format; use one of \['float', 'int8'\]"):
        popjax.load(directory, weights="int4")
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported \(the compute dtype; int8 is a weight format"):
        popjax.load(directory, dtype="int8")
    with pytest.raises(ValueError, match=r"activations='int4' is not supported; use one of \['float', 'int8'\]"):
        popjax.load(directory, weights="int8", activations="int4")
    with pytest.raises(ValueError, match=r"activations='int8' needs int8 weights"):
        popjax.load(directory, cache=False, activations="int8")
    store = popjax.convert_source(directory, tmp_path / "int8", weights="int8")
    with pytest.raises(CheckpointError, match=r"was converted with weights='int8'; load it with weights='int8'"):
        popjax.load(store, weights="float")
    # a failed quantization leaves no cache entry
    from popjax.cache import list_entries
    from popjax.convert import fused

    before = {e.key for e in list_entries()}

    def broken(w):
        raise RuntimeError("quantization failed")

    monkeypatch.setattr(fused, "quantize", broken)
    with pytest.raises(RuntimeError, match="quantization failed"):
        popjax.load(directory, dtype="bfloat16", weights="int8")
    assert {e.key for e in list_entries()} == before


def test_prefill_only_calibrated_kv_on_int8(int8_pair):
    """Prefill-Only's calibrated K/V projections fit on an int8 model (from its dequantized k/v
    rows) and run through generate as every calibrated method does."""
    from popjax.methods.prefill_only.calibrate import calibrate_kv

    model, _ = int8_pair
    prompts = [np.random.default_rng(2).integers(3, 160, 24).tolist() for _ in range(4)]
    calibration = calibrate_kv(model, (1,), prompts, window=24, cache=False)
    method = popjax.PrefillOnly(skip=(1,), kv="calibrated", kv_calibration=calibration) + popjax.POP(0.3)
    ids, _ = popjax.generate_ids(model, [[5, 17, 3, 99, 42, 7]], 4, method=method, ignore_eos=True)
    assert len(ids[0]) == 4
