"""Scale-out (popjax.sharding) on one device: logical axes, the rules table, mesh errors, and POP's
per-shard partition against a NumPy reference. Every method on meshes of 8 fake devices:
tests/scale/test_eight_devices.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.scale.eight_devices import ATOL, random_tree, tiny_config


# ----------------------------------------------------------------------------- rules and errors (one device)


def _abstract_mesh(data: int, model: int):
    import jax

    return jax.sharding.AbstractMesh((data, model), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_every_parameter_has_logical_axes_of_its_rank():
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from popjax import sharding
    from popjax.loading import build_model

    for cfg in (tiny_config(), tiny_config(model_type="qwen3", qk_norm=True, tie_word_embeddings=True)):
        model = build_model(cfg, random_tree(cfg), None, "tiny", "float32")
        leaves = list(sharding.param_paths(nnx.to_pure_dict(model.params)))
        assert len(leaves) > 10
        for path, leaf in leaves:
            axes = sharding.param_axes(path, cfg)
            assert len(axes) == leaf.ndim, (path, axes, leaf.shape)
            assert all(a in sharding.RULES for a in axes)
    # the FFN channel axis lands on "model", the hidden size is replicated
    assert sharding.partition_spec(sharding.param_axes("layers.0.mlp.down", tiny_config()), {"data": 2, "model": 4}) == P(None, "model")
    assert sharding.partition_spec(sharding.CACHE_AXES, {"data": 2, "model": 4}) == P("data", None, "model", None)
    # a mesh axis of size 1 is dropped, so the single-device spec is fully replicated
    assert sharding.partition_spec(sharding.CACHE_AXES, {"data": 1, "model": 1}) == P(None, None, None, None)


def test_qkv_is_grouped_by_kv_head():
    """``attn.qkv`` [n_kv, g + 2, h, d]: KV group i holds query heads i·g … i·g + g − 1 (the heads
    that attend with KV head i), then key head i, then value head i; `split_qkv` inverts it and
    `group_kv` maps a calibration's k-then-v rows onto the group's last two parts."""
    from popjax.models.layers import fuse_qkv, group_kv, split_qkv

    cfg = tiny_config(num_attention_heads=6, num_key_value_heads=2, head_dim=3, hidden_size=5)
    g, h, rng = 3, 3, np.random.default_rng(0)
    for rest in ((5,), ()):  # weights [rows, d] and biases [rows]
        q, k, v = (rng.normal(size=(n * h, *rest)) for n in (6, 2, 2))
        qkv = fuse_qkv(q, k, v, cfg)
        assert qkv.shape == (2, g + 2, h, *rest)
        for i in range(2):
            for j in range(g):
                np.testing.assert_array_equal(qkv[i, j], q[(i * g + j) * h : (i * g + j + 1) * h])
            np.testing.assert_array_equal(qkv[i, g], k[i * h : (i + 1) * h])
            np.testing.assert_array_equal(qkv[i, g + 1], v[i * h : (i + 1) * h])
        for got, want in zip(split_qkv(qkv, cfg), (q, k, v)):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(group_kv(np.concatenate([k, v]), cfg), qkv[:, g:])


def test_abstract_params_carry_shardings_without_allocating():
    from flax import nnx

    from popjax import sharding

    mesh = sharding.make_mesh((1, 1))
    state = sharding.abstract_params(tiny_config(), mesh)
    leaves = dict(sharding.param_paths(nnx.to_pure_dict(state)))
    assert leaves["layers.1.mlp.gate_up"].shape == (2, 256, 64)
    assert leaves["layers.1.mlp.gate_up"].sharding.mesh == mesh


def test_unknown_logical_axis_and_parameter_are_errors():
    from popjax import sharding

    with pytest.raises(ValueError, match=r"unknown logical axis 'vision_patches'.*valid axes"):
        sharding.partition_spec(("vision_patches", "embed"))
    with pytest.raises(ValueError, match=r"parameter 'layers.0.mlp.lora_a' has no logical axes: the llama model declares"):
        sharding.param_axes("layers.0.mlp.lora_a", tiny_config())
    # MoE parameters declare axes: expert stacks replicated, each expert's channels over "model"
    from popjax.models.config import ModelConfig

    moe = ModelConfig.from_hf_dict(dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                                        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2))
    assert sharding.param_axes("layers.1.mlp.experts.gate_up", moe) == ("experts", "mlp_pair", "mlp", "embed")
    # int8 scales declare their weight's axes, none on the input axis

    assert sharding.param_axes("layers.0.mlp.gate_up_scale", dataclasses.replace(tiny_config(), weights="int8")) == ("mlp_pair", "mlp", None)


def test_mesh_that_does_not_divide_the_model_is_an_error():
    from popjax import sharding

    with pytest.raises(ValueError, match=r"model axis of size 8 does not divide num_attention_heads=12.*\[1, 2, 3, 4, 6, 12\]"):
        sharding.check_mesh(tiny_config(num_attention_heads=12, num_key_value_heads=4), _abstract_mesh(1, 8))
    with pytest.raises(ValueError, match=r"num_key_value_heads=2"):
        sharding.check_mesh(tiny_config(num_key_value_heads=2), _abstract_mesh(2, 4))
    with pytest.raises(ValueError, match=r"intermediate_size=100"):
        sharding.check_mesh(tiny_config(intermediate_size=100), _abstract_mesh(1, 8))
    with pytest.raises(ValueError, match=r"batch of 6 rows.*data axis of size 4"):
        sharding.check_batch(6, _abstract_mesh(4, 2))
    sharding.check_mesh(tiny_config(), _abstract_mesh(2, 4))  # divides: no error


def test_make_mesh_errors_name_the_shape():
    from popjax import sharding

    with pytest.raises(ValueError, match=r"mesh shape \(2, 8\) needs 16 devices"):
        sharding.make_mesh((2, 8))
    with pytest.raises(ValueError, match=r"two integers"):
        sharding.make_mesh((1, 2, 3))
    assert dict(sharding.make_mesh((1, -1)).shape) == {"data": 1, "model": 1}


def test_constraints_are_no_ops_without_a_mesh():
    import jax.numpy as jnp

    from popjax import sharding

    x = jnp.ones((2, 4, 8, 2))
    assert sharding.constrain(x, sharding.CACHE_AXES) is x


# ----------------------------------------------------------------------------- POP per shard vs NumPy


def _silu(x):
    return x / (1.0 + np.exp(-x))


def ref_per_shard_prefill(gate, up, down, X, valid, shards, keep, m):
    """gate, up [f, d]; down [d, f]; float64 loops -> (Y, R, C) with R, C lists of global ids per shard."""
    f = gate.shape[0]
    block = f // shards
    H = _silu(X @ gate.T) * (X @ up.T)
    norms = np.sqrt((down ** 2).sum(axis=0))
    imp = np.array([np.sqrt(sum(H[b, t, j] ** 2 for b in range(X.shape[0]) for t in range(X.shape[1]) if valid[b, t])) * norms[j]
                    for j in range(f)])
    R, C, kept = [], [], []
    for s in range(shards):
        ids = list(range(s * block, (s + 1) * block))
        order = sorted(ids, key=lambda j: (-imp[j], j))
        R.append(order[: keep - m])
        C.append(order[keep - m : keep + m])
        kept += order[:keep]
    return H[..., kept] @ down[:, kept].T, R, C


def ref_per_shard_decode(gate, up, down, x, R, C, m):
    H = _silu(x @ gate.T) * (x @ up.T)  # [B, 1, f]
    norms = np.sqrt((down ** 2).sum(axis=0))
    used, selected = [], []
    for r, c in zip(R, C):
        score = {j: np.sqrt((H[:, 0, j] ** 2).sum()) * norms[j] for j in c}
        pick = sorted(c, key=lambda j: (-score[j], c.index(j)))[:m]
        selected.append(pick)
        used += list(r) + pick
    return H[..., used] @ down[:, used].T, selected


def test_pop_per_shard_matches_reference():
    import jax.numpy as jnp

    from popjax.methods import POP
    from popjax.methods.pop.core import POPShardedPlan

    rng = np.random.default_rng(3)
    cfg = tiny_config(intermediate_size=64)
    plan = POP(0.3, partition="per_shard", shards=4, gamma=0.25, aggregate="shared").bind(cfg)
    assert isinstance(plan, POPShardedPlan) and plan.shards == 4 and plan.m >= 1
    keep, m = plan.n_keep // 4, plan.m
    d, f = 64, 64
    gate, up, down = (rng.normal(size=s) * 0.3 for s in ((f, d), (f, d), (d, f)))
    w = _ffn_weights(np.stack([gate, up]), down)
    X = rng.normal(size=(2, 5, d))
    valid = np.ones((2, 5), bool)
    valid[1, :2] = False  # left padding stays out of the ranking
    X[1, :2] = 50.0
    y, state, _ = plan.prefill(w, jnp.asarray(X, jnp.float32), jnp.asarray(valid))
    Y, R, C = ref_per_shard_prefill(gate, up, down, X, valid, 4, keep, m)
    assert np.asarray(state["retained_idx"]).tolist() == R
    assert np.asarray(state["candidate_idx"]).tolist() == C
    np.testing.assert_allclose(np.asarray(y)[valid], Y[valid], atol=ATOL)
    x = rng.normal(size=(2, 1, d))
    step_valid = np.array([[True], [False]])  # a stopped row does not vote
    y, _, aux = plan.decode(w, state, jnp.asarray(x, jnp.float32), jnp.int32(0), jnp.asarray(step_valid))
    want, selected = ref_per_shard_decode(gate, up, down, x[:1], R, C, m)
    assert np.asarray(aux["selected"]).tolist() == selected
    np.testing.assert_allclose(np.asarray(y)[:1], want, atol=ATOL)


def _ffn_weights(gate_up, down):
    """gate_up [2, f, d], down [d, f] (numpy) -> the FFNWeights a plan receives."""
    import jax.numpy as jnp

    from popjax.models.interface import FFNWeights

    down = jnp.asarray(down, jnp.float32)
    return FFNWeights(jnp.asarray(gate_up, jnp.float32), down, jnp.sqrt(jnp.sum(down**2, axis=0)))


def test_pop_per_shard_with_one_shard_is_global_pop():
    import jax.numpy as jnp

    from popjax.methods import POP

    rng = np.random.default_rng(4)
    cfg = tiny_config(intermediate_size=64)
    one, glob = POP(0.3, partition="per_shard", shards=1, aggregate="shared").bind(cfg), POP(0.3, aggregate="shared").bind(cfg)
    assert (one.n_keep, one.m) == (glob.n_keep, glob.m)
    w = _ffn_weights(rng.normal(size=(2, 64, 64)) * 0.3, rng.normal(size=(64, 64)) * 0.3)
    x, valid = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32), jnp.ones((2, 4), bool)
    (y1, s1, _), (y2, s2, _) = one.prefill(w, x, valid), glob.prefill(w, x, valid)
    assert np.asarray(s1["retained_idx"])[0].tolist() == np.asarray(s2["retained_idx"]).tolist()
    assert np.asarray(s1["candidate_idx"])[0].tolist() == np.asarray(s2["candidate_idx"]).tolist()
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), atol=ATOL)
    xt = x[:, :1]
    (y1, _, a1), (y2, _, a2) = (p.decode(w, s, xt, jnp.int32(0), valid[:, :1]) for p, s in ((one, s1), (glob, s2)))
    assert np.asarray(a1["selected"])[0].tolist() == np.asarray(a2["selected"]).tolist()
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), atol=ATOL)


def test_pop_partition_errors_and_mesh_default():

    from popjax.methods import POP, MethodError, parse_method_spec

    with pytest.raises(MethodError, match=r"partition='rows' is not one of \('global', 'per_shard'\)"):
        POP(0.2, partition="rows")
    with pytest.raises(MethodError, match=r"shards=0 is invalid"):
        POP(0.2, partition="per_shard", shards=0)
    with pytest.raises(MethodError, match=r"shards=4 applies to partition='per_shard' only"):
        POP(0.2, shards=4)
    with pytest.raises(MethodError, match=r"shards=3 does not divide the FFN width f=256"):
        POP(0.2, partition="per_shard", shards=3).bind(tiny_config())
    assert parse_method_spec("pop:partition=per_shard:shards=8") == POP(0.2, partition="per_shard", shards=8)

    @dataclasses.dataclass
    class Sharded:
        mesh: object

    assert POP(0.2, partition="per_shard").prepare(Sharded(_abstract_mesh(2, 4))).shards == 4
    assert POP(0.2).prepare(Sharded(_abstract_mesh(2, 4))).shards is None
