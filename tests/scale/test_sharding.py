"""Scale-out (popjax.sharding): logical axes, the rules table, mesh errors, POP's per-shard
partition against a NumPy reference, and — in ONE subprocess with 8 fake CPU devices — every
method's tokens and log-probabilities on the (2, 4) mesh (and (8, 1) where a method reduces over
rows) against one device, plus the collectives and split copies of the compiled prefill and decode
step on (1, 8).

Run: ``python -m pytest -q tests/scale/test_sharding.py``; the 8-device worker alone:
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/scale/test_sharding.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

MESHES = ((8, 1), (1, 8), (2, 4))
# (8, 1) splits only the batch: it can break only what a method computes across rows (POP's
# shared scores, per-sequence selections); (1, 8) and (2, 4) split the channels as well.
BATCH_ONLY_METHODS = ("dense", "pop-shared", "pop-per_sequence")
ATOL = 1e-5
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW_TOKENS = 8


def tiny_config(**overrides):
    """LLaMA-style, sized so every split of an 8-device mesh divides: heads 16, kv heads 8,
    f 256 (32 channels per shard), vocabulary 256."""
    from popjax.models.config import ModelConfig

    fields = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=False)
    return ModelConfig(**{**fields, **overrides})


def random_tree(cfg, seed: int = 0) -> dict:
    """A converted-checkpoint tree (HF layout: q/k/v and gate/up apart) of random weights."""
    rng = np.random.default_rng(seed)
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    w = lambda *shape: (rng.normal(size=shape) * 0.15).astype(np.float32)
    norm = lambda n: {"weight": (1 + 0.1 * rng.normal(size=n)).astype(np.float32)}
    layer = lambda: {
        "attn_norm": norm(d), "mlp_norm": norm(d),
        "attn": {"q": w(cfg.num_attention_heads * h, d), "k": w(cfg.num_key_value_heads * h, d),
                 "v": w(cfg.num_key_value_heads * h, d), "o": w(d, cfg.num_attention_heads * h)},
        "mlp": {"gate": w(f, d), "up": w(f, d), "down": w(d, f)},
    }
    if cfg.sandwich_norms:  # Gemma: norms on the attention and FFN outputs as well
        layer_without_post = layer
        layer = lambda: {**layer_without_post(), "attn_post_norm": norm(d), "mlp_post_norm": norm(d)}
    if cfg.qk_norm:
        layer_without_norms = layer
        layer = lambda: (lambda t: {**t, "attn": {**t["attn"], "q_norm": norm(h), "k_norm": norm(h)}})(layer_without_norms())
    tree = {"embed": w(cfg.vocab_size, d), "final_norm": norm(d), "layers": {str(i): layer() for i in range(cfg.num_hidden_layers)}}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = w(cfg.vocab_size, d)
    return tree



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
    import pytest

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
    import pytest

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
    import pytest

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

    import pytest

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


# ----------------------------------------------------------------------------- the 8-device worker
# fewer LLVM passes and the older loop emitters (conftest.TINY_PROGRAM_XLA_FLAGS): compiles dominate the run
WORKER_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false")


def core_meshes(name: str) -> tuple[tuple[int, int], ...]:
    """The meshes a core method is teacher-forced on: (2, 4), which splits the batch and the
    channels at once, and (8, 1) as well for those that reduce over rows. (1, 8) runs every
    core method's prefill and decode step below (the collective counts, the split copies)."""
    return ((8, 1), (2, 4)) if name in BATCH_ONLY_METHODS else ((2, 4),)


def core_methods():
    import popjax

    return {
        "dense": popjax.Dense(),
        "static": popjax.Static(0.3),
        "pop-shared": popjax.POP(0.3),
        "pop-per_sequence": popjax.POP(0.3, aggregate="per_sequence"),
        "pop-per_shard": popjax.POP(0.3, partition="per_shard", shards=8),
    }


def other_methods(model):
    """Every other registered method: those that need calibration data calibrated on random
    tokens (TEAL, CATS, FLAP), given their selection (Wanda-sp) or their drift (the layer
    bands), or prepared (the low-rank POP's SVD factors). Only methods with a model."""
    import popjax
    from popjax.methods import make_method

    out = {"dynamic": popjax.Dynamic(0.3), "griffin": popjax.GRIFFIN(0.3), "probe": popjax.ProbePruning(0.3),
           "bwap": popjax.BWAP(), "prefill-only+pop": popjax.PrefillOnly() + popjax.POP(0.3)}
    out["pop-shortlist"] = make_method("pop-shortlist", ratio=0.3, gamma=0.4)  # runs pop-gate's scoring too
    out["dynamic-shortlist"] = make_method("dynamic-shortlist", ratio=0.3)
    out["pop-gate"] = make_method("pop-gate", ratio=0.3, gamma=0.2)
    out["pop-bands"] = popjax.LayerBandsPOP(0.3, gamma=0.2).with_drift([0.1, 0.9])  # bands from a given drift
    out["pop-pallas"] = popjax.POP(0.3, gamma=0.2, kernel="pallas")  # the kernel on every device (interpret mode)
    if model is not None:  # calibrated for real, on random tokens (seconds on this model; not cached)
        from popjax.calibration import Corpus

        out["pop-lowrank"] = popjax.LowRankPOP(0.3, gamma=0.2, rank=8)  # its SVD factors
        corpus = Corpus("random", np.random.default_rng(6).integers(0, model.config.vocab_size, (4, 32)))
        out["wina"] = popjax.WINA(0.3)  # its column norms (prepared by the worker)
        for name, method in (("teal", popjax.TEAL(0.3)), ("cats", popjax.CATS(0.3)), ("flap", popjax.FLAP(0.3)),
                             ("glass", popjax.GLASS(0.3, aggregate="per_sequence")), ("larosa", popjax.LaRoSa(0.3)),
                             ("principal-teal", popjax.PrincipalTEAL(0.3, rank=2))):
            out[name] = method.calibrate(model, corpus, cache=False)  # Wanda-sp from a hand-made selection (no calibration): its kept rows split like static's
        out["teal-pallas"] = dataclasses.replace(out["teal"], kernel="pallas")  # its replicated copies, the kernel on every device
        from popjax.methods.wanda_sp import ChannelSelection

        cfg, rng = model.config, np.random.default_rng(5)
        n_keep = popjax.WandaSP(0.3).n_keep(cfg)
        kept = tuple(tuple(sorted(rng.choice(cfg.intermediate_size, n_keep, replace=False).tolist()))
                     for _ in range(cfg.num_hidden_layers))
        out["wanda-sp"] = popjax.WandaSP(0.3, selection=ChannelSelection("wanda-sp", 0.3, kept))
    return out


def _teacher(model, plan, tokens, mask, targets, data=None):
    import jax.numpy as jnp

    from popjax import engine, sharding

    with sharding.use_mesh(model):
        nll, logp, _ = engine.teacher_force(model.graphdef, model.params, plan, jnp.asarray(tokens), jnp.asarray(mask),
                                            jnp.asarray(targets), with_logprobs=True, data=data)
        return np.asarray(logp)


def compiled_start(model, method):
    """The request for PROMPTS, the carry after its prefill and the compiled prefill's HLO text.
    The prefill runs from the executable whose HLO is read, so it compiles once; the decode-step
    and method-state checks below share it."""
    import jax.numpy as jnp

    from popjax import engine, sharding
    from popjax.requests import GenerationRequest

    req = GenerationRequest.create(model, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)
    with sharding.use_mesh(model):
        args = (req.tokens, req.mask, req.key, req.sampling, jnp.asarray(req.stops), jnp.int32(req.pad_id))
        compiled = engine.start.lower(model.graphdef, model.params, req.plan, *args, capacity=req.capacity,
                                      data=req.data).compile()
        carry, _ = compiled(model.params, *args, data=req.data)
    return req, carry, compiled.as_text()


def _decode_step_hlo(model, started) -> str:
    """The compiled decode step's HLO text after ``started = compiled_start(model, method)``."""
    import jax.numpy as jnp

    from popjax import engine, sharding

    req, carry, _ = started
    with sharding.use_mesh(model):
        lowered = engine.stream_step.lower(model.graphdef, model.params, req.plan, carry, req.sampling,
                                           jnp.asarray(req.stops), jnp.int32(req.pad_id), data=req.data)
    return lowered.compile().as_text()


def largest_all_gather(hlo: str) -> int:
    """Elements of the largest all-gather in compiled HLO text (0 without one)."""
    from popjax import sharding

    return max((n for _, n in sharding.collective_operands(hlo, "all-gather")), default=0)


def method_state_after_prefill(model, started) -> dict:
    """The prefill's method states after ``started = compiled_start(model, method)``: bytes in
    all and held by one device, and the largest all-gather of the compiled prefill (elements)."""
    import jax

    _, carry, prefill_hlo = started
    leaves = jax.tree_util.tree_leaves_with_path(carry.state.method_states)
    one_device = lambda a: a.addressable_shards[0].data.nbytes
    replicated = [(path[-1].key, a) for path, a in leaves if one_device(a) == a.nbytes]
    return {"total": sum(a.nbytes for _, a in leaves),
            "one_device": sum(one_device(a) for _, a in leaves),
            "replicated_bytes": sum(a.nbytes for _, a in replicated),
            # weight copies: leaves with a hidden-size (d) axis
            "replicated_weights": sorted({name for name, a in replicated if model.config.hidden_size in a.shape}),
            "prefill_largest_all_gather": largest_all_gather(prefill_hlo)}


def restore_straight_into_shardings(cfg, tree, placed) -> dict:
    """``popjax.load(converted dir, mesh=(1, 8))``, unrolled and scanned, with host placement
    (``sharding.place``) forbidden: orbax must restore every tensor into its sharding. -> per
    layout: the largest difference to ``placed`` (built from host arrays), for the stored
    tensors and for the derived ones, and the leaves whose sharding differs from the rules'."""
    import tempfile
    from unittest import mock

    import jax
    from flax import nnx

    import popjax
    from popjax import sharding
    from popjax.convert.store import dotted, write_converted
    from popjax.loaded import with_scanned_layers

    directory = Path(tempfile.mkdtemp()) / "model"
    write_converted(directory, cfg, tree, lambda _: False, {"source": "random", "kind": "hf", "dtype": "float32"})
    mesh = placed.mesh
    out = {}
    for layout, want_model in (("unrolled", placed), ("scanned", with_scanned_layers(placed))):
        with mock.patch.object(sharding, "place", side_effect=AssertionError("a host array was placed")):
            got_model = popjax.load(directory, mesh=mesh, scan_layers=layout == "scanned")
        got, want = nnx.to_pure_dict(got_model.params), nnx.to_pure_dict(want_model.params)
        diffs, derived, wrong = [], [0.0], []
        for (keys, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)):
            path = dotted(keys)
            # ‖W_d[:, j]‖₂ is computed after loading (per layer, or on the stack): rounding only
            (derived if path.endswith("down_norm") else diffs).append(float(np.abs(np.asarray(a) - np.asarray(b)).max()))
            if not a.sharding.is_equivalent_to(sharding.param_sharding(path, tuple(a.shape), mesh, cfg), a.ndim):
                wrong.append(path)
        out[layout] = {"leaves": len(diffs), "max_abs_diff": max(diffs), "max_abs_diff_derived": max(derived),
                       "wrong_shardings": wrong}
    return out


INT8_METHODS = ("dense", "static", "pop-shared", "pop-per_shard")


def int8_on_meshes(cfg, tree, tokens, mask, targets) -> dict:
    """The int8 model of ``tree`` on one device and on meshes (1, 8), (2, 4): each scale's
    sharding against its weight's (equal on every axis but the weight's input axis), and on the
    (2, 4) mesh the log-probabilities of the methods that read int8 rows split over the model
    axis (the whole weights, kept rows, per-shard blocks). The per-sequence gather of int8 rows
    is test_int8.py's, on one device; its split is the float model's, above."""

    from flax import nnx

    from popjax import sharding
    from popjax.loading import build_model

    cfg8 = dataclasses.replace(cfg, weights="int8")
    single = build_model(cfg8, tree, None, "tiny-int8", "float32")
    out = {"methods": {}, "scales_checked": 0, "scales_split_unlike_weights": []}
    meshes = ((1, 8), (2, 4))
    sharded = {shape: build_model(cfg8, tree, None, "tiny-int8", "float32", sharding.make_mesh(shape)) for shape in meshes}
    leaves = dict(sharding.param_paths(nnx.to_pure_dict(sharded[(1, 8)].params)))
    for path, scale in leaves.items():
        if path.endswith("_scale"):
            weight = leaves[path[: -len("_scale")]]
            w_spec, s_spec = weight.sharding.spec, scale.sharding.spec
            pad = lambda spec: tuple(spec) + (None,) * (weight.ndim - len(spec))
            out["scales_checked"] += 1
            if pad(w_spec)[:-1] != pad(s_spec)[:-1] or pad(s_spec)[-1] is not None:
                out["scales_split_unlike_weights"].append([path, str(w_spec), str(s_spec)])
    for name in INT8_METHODS:
        plan = core_methods()[name].bind(cfg8)
        want = _teacher(single, plan, tokens, mask, targets)[: len(PROMPTS)]
        got = _teacher(sharded[(2, 4)], plan, tokens, mask, targets)[: len(PROMPTS)]
        out["methods"][name] = {"(2, 4)": {"max_abs_logprob_diff": float(np.abs(got - want).max()),
                                           "greedy_same": bool((got.argmax(-1) == want.argmax(-1)).all())}}
    # per-step row copies of an int8-activation model keep its activation format on a mesh too
    # (tests/models/test_int8.py checks one device; this worker runs as a script, without the tests package)
    import jax
    import jax.numpy as jnp

    from popjax import engine
    from popjax.kernels.int8 import Int8Weight
    from popjax.methods import make_method

    fast = build_model(dataclasses.replace(cfg8, activations="int8"), tree, None, "tiny-int8", "float32", sharding.make_mesh((2, 4)))
    out["step_row_formats"] = {}
    for name in ("pop-gate", "pop-shortlist"):
        with sharding.use_mesh(fast):
            _, _, states, _ = engine.prefill(fast.graphdef, fast.params, jnp.asarray(tokens), jnp.asarray(mask),
                                             make_method(name).bind(fast.config))
        leaves = jax.tree_util.tree_leaves(states, is_leaf=lambda a: isinstance(a, Int8Weight))
        out["step_row_formats"][name] = sorted({a.activations for a in leaves if isinstance(a, Int8Weight)})
    return out


def worker(out_path: str, all_methods: bool = False) -> None:
    """Runs in the 8-device subprocess; writes its findings as JSON for the tests to check.

    Every method is teacher-forced through prefill and NEW_TOKENS decode steps on fixed random
    targets: equal log-probabilities and equal argmax at every step mean equal greedy choices
    for any prefix; the full greedy loop (generate_ids) runs on a mesh for dense and POP per shard."""
    import jax

    import popjax
    from popjax import sharding
    from popjax.generation import generate_ids
    from popjax.requests import pad_batch
    from popjax.loading import build_model

    start = time.process_time()
    cfg, tree = tiny_config(), random_tree(tiny_config())
    single = build_model(cfg, tree, None, "tiny", "float32")
    sharded = {shape: build_model(cfg, tree, None, "tiny", "float32", sharding.make_mesh(shape)) for shape in MESHES}
    tokens, mask = pad_batch(PROMPTS, 0, min_rows=8)  # 8 rows: the (8, 1) mesh splits the batch 8 ways
    results = {"devices": len(jax.devices()), "methods": {}, "collectives": {}, "generate": {}}
    runs = [(name, m, core_meshes(name)) for name, m in core_methods().items()]
    others = other_methods(single)  # calibrated once: the runs below and the split-copy checks share them
    if all_methods:  # the (2, 4) mesh splits the batch and the channels at once: what a mesh can break
        runs += [(name, m.prepare(single), ((2, 4),)) for name, m in others.items()]
    # registry names covered (a composite counts for its FFN method too)
    results["registry_names"] = sorted({n for _, m, _ in runs for n in (m.name, m.ffn_method.name if m.layer_level else m.name)})
    targets = np.random.default_rng(1).integers(0, cfg.vocab_size, (tokens.shape[0], NEW_TOKENS)).astype(np.int32)
    for name, method, meshes in runs:
        plan, data = method.bind(cfg), method.data(single)
        want = _teacher(single, plan, tokens, mask, targets, data)[: len(PROMPTS)]
        entry = {}
        for shape in meshes:
            got = _teacher(sharded[shape], plan, tokens, mask, targets, data)[: len(PROMPTS)]
            entry[str(shape)] = {"max_abs_logprob_diff": float(np.abs(got - want).max()),
                                 "greedy_same": bool((got.argmax(-1) == want.argmax(-1)).all())}
        results["methods"][name] = entry
    for name, method in (("pop-per_shard", core_methods()["pop-per_shard"]),):
        ids, _ = generate_ids(sharded[(2, 4)], PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)
        want, _ = generate_ids(single, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)
        results["generate"][name] = ids == want
    # smaller than any FFN weight matrix or compact block (d·f, d·n_keep), larger than any
    # activation or logits row block ([B, V], [B, f]): an operand this size is weights moving
    weight_elements = cfg.hidden_size * cfg.hidden_size
    split_copies = {name: core_methods()[name]
                    for name in ("static", "pop-shared", "pop-per_sequence", "pop-per_shard")}
    split_copies["bwap"] = popjax.BWAP(0.3)
    split_copies.update({name: others[name] for name in ("wanda-sp", "pop-gate", "pop-bands")})
    split_copies["pop-lowrank"] = others["pop-lowrank"].prepare(single)
    step_methods = {**core_methods(), **split_copies,
                    "pop-per_shard-gather": popjax.POP(0.3, partition="per_shard", shards=8, weights="gather")}
    hlo_methods = ("dense", "static", "pop-shared", "pop-per_shard", "bwap", "pop-per_shard-gather")
    started = {name: compiled_start(sharded[(1, 8)], step_methods[name]) for name in dict.fromkeys([*hlo_methods, *split_copies])}
    for name in hlo_methods:
        hlo = _decode_step_hlo(sharded[(1, 8)], started[name])
        results["collectives"][name] = {
            "counts": sharding.count_collectives(hlo),
            "largest_all_gather": largest_all_gather(hlo),
            "weight_threshold_elements": weight_elements,
        }
    results["state_after_prefill"] = {name: method_state_after_prefill(sharded[(1, 8)], started[name])
                                      for name in split_copies}
    results["restore"] = restore_straight_into_shardings(cfg, tree, sharded[(1, 8)])
    results["int8"] = int8_on_meshes(cfg, tree, tokens, mask, targets)
    results["cpu_seconds"] = time.process_time() - start
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    worker(sys.argv[1], all_methods="--all" in sys.argv)


def run_worker(tmp_path, *args: str) -> dict:
    out = tmp_path / "sharding.json"
    env = {**os.environ, "XLA_FLAGS": WORKER_FLAGS, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, __file__, str(out), *args], env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def check_methods(results: dict) -> None:
    for name, entry in results["methods"].items():
        for shape, got in entry.items():
            assert got["greedy_same"], (name, shape)
            assert got["max_abs_logprob_diff"] <= ATOL, (name, shape, got)


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory) -> dict:
    """The one subprocess with 8 fake devices (the rest of the suite keeps one), run once for
    both tests below: every method, the generate loop and the collective counts."""
    return run_worker(tmp_path_factory.mktemp("eight_devices"), "--all")


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_other_methods(eight_devices):
    """Every registered method (calibrated ones on random tokens) matches one device on the
    (2, 4) mesh, which splits both the batch and the channels (the core methods of the next test
    on (8, 1) as well where they reduce over rows): log-probabilities within 1e-5, the same greedy choices."""
    from popjax.methods import METHODS

    assert set(other_methods(None)) <= set(eight_devices["methods"])
    assert set(METHODS) <= set(eight_devices["registry_names"]), sorted(set(METHODS) - set(eight_devices["registry_names"]))
    for name, entry in eight_devices["methods"].items():
        assert set(entry) == ({str(shape) for shape in core_meshes(name)} if name in core_methods() else {"(2, 4)"}), (name, entry)
    check_methods(eight_devices)


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_int8_weights(eight_devices):
    """An int8 model (popjax/kernels/int8.py) on meshes (1, 8) and (2, 4): every scale is split like
    the output axes of its weight, and dense, static and POP (shared, per shard) give one
    device's log-probabilities and greedy choices on the (2, 4) mesh."""
    int8 = eight_devices["int8"]
    assert int8["scales_checked"] >= 8 and not int8["scales_split_unlike_weights"], int8
    assert set(int8["methods"]) == set(INT8_METHODS)
    check_methods({"methods": int8["methods"]})
    assert int8["step_row_formats"] == {"pop-gate": ["int8"], "pop-shortlist": ["int8"]}, int8["step_row_formats"]


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_match_one_device(eight_devices):
    """Dense, static and POP (shared, per sequence, per shard) give the log-probabilities and
    greedy choices of one device on the (2, 4) mesh, and those that reduce over rows on (8, 1)
    as well (`BATCH_ONLY_METHODS`); the greedy loop of POP per shard its tokens; the compiled
    decode step on (1, 8)
    moves no weights and, but for the global partition's scores, no activations between devices
    (nor do BWAP's, or per-shard POP's with weights="gather", which gathers
    its rows from the model's [2, f, d] gate/up at every step: each shard from its own block)."""
    results = eight_devices
    print(json.dumps(results, indent=1))  # the collective counts, for docs/sharding.md (pytest -s)
    assert results["devices"] == 8
    assert set(core_methods()) <= set(results["methods"])
    check_methods(results)
    assert all(results["generate"].values()), results["generate"]
    for name, found in results["collectives"].items():
        assert found["counts"]["all-to-all"] == 0, (name, found)
        assert found["largest_all_gather"] < found["weight_threshold_elements"], (name, found)
        if name != "pop-shared":  # q/k/v grouped by KV head: attention moves nothing between devices;
            # only the global partition's candidate selection (pop-shared) permutes scores
            assert found["counts"]["collective-permute"] == 0, (name, found)


# Replicated by design: rows every decode step gathers its selection from (by positions that differ
# per step) and the low-rank scoring factors.
CANDIDATE_ROWS = {"down_candidates", "up_candidates", "gate_up_candidates", "band_gate_up", "band_down_rows",
                  "score_in", "score_out"}
# candidate rows (pop-gate: up and down, 2·n_C·d) and scoring factors outweigh their split blocks here
CANDIDATE_HEAVY = {"pop-gate", "pop-lowrank", "pop-bands"}


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_compact_copies_are_split(eight_devices):
    """Static, POP (global partition, shared or per sequence, and per shard), BWAP, Wanda-sp and
    POP's variants (gate-scored, low-rank, layer bands) keep their compact copies split over the
    model axis: one device of the (1, 8) mesh holds under a quarter of the method state (the kept
    rows and the per-shard blocks are 1/8; candidate rows that every step gathers from, replicated,
    are the rest), and the prefill that copies them never all-gathers an
    FFN weight matrix (before base.copy_channels, per-sequence POP's prefill gathered all of
    gate_up and [B, 2, n_R + n_C, d] blocks)."""
    cfg = tiny_config()
    threshold = cfg.hidden_size * cfg.intermediate_size  # the smallest FFN weight matrix, d·f
    for name, found in eight_devices["state_after_prefill"].items():
        assert found["one_device"] < found["total"] / 4 or name in CANDIDATE_HEAVY, (name, found)
        # every other leaf is split 8 ways exactly (padded to a multiple of 8 channels)
        split = found["total"] - found["replicated_bytes"]
        assert 8 * (found["one_device"] - found["replicated_bytes"]) == split, (name, found)
        assert set(found["replicated_weights"]) <= CANDIDATE_ROWS, (name, found)
        assert found["prefill_largest_all_gather"] < threshold, (name, found)


@pytest.mark.slow  # starts the 8-device worker process
def test_eight_devices_restore_into_shardings(eight_devices):
    """``popjax.load(converted dir, mesh=(1, 8))`` restores every tensor straight into its
    sharding (no host placement), unrolled and scanned, with the host path's exact values."""
    # Two layers of six tensors plus embedding, final norm and LM head; scanned: one stack per kind.
    expected_leaves = {"unrolled": 2 * 6 + 3, "scanned": 6 + 3}
    assert set(eight_devices["restore"]) == set(expected_leaves), eight_devices["restore"]
    for layout, found in eight_devices["restore"].items():
        assert found["leaves"] == expected_leaves[layout], (layout, found)
        assert found["max_abs_diff"] == 0.0, (layout, found)
        assert found["max_abs_diff_derived"] <= 1e-6, (layout, found)
        assert found["wrong_shardings"] == [], (layout, found)
