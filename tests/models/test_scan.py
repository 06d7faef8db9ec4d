"""Scanned decoder layers (models/scan.py): the scanned model equals the unrolled one (forward
logits and teacher-forced NLL/log-probabilities for dense, static, POP shared and per-sequence
and BWAP; greedy tokens and traces of generate, streaming) on LLaMA- and Qwen3-style tiny random
models; one compile per bucket;
``load(..., mesh=..., scan_layers=True)`` on one device; the clear errors for what a scan cannot
run (non-identical layers, per-layer prefill modes, gates).

Run: ``python -m pytest -q tests/models/test_scan.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import popjax
from popjax import engine
from popjax.requests import GenerationRequest, pad_batch
from popjax.loading import build_model
from popjax.models.interface import CacheView, FFNHook, ModelInputs
from popjax.loaded import with_scanned_layers
from popjax.methods.teal import TEALPlan, thresholds_data
from popjax.models.config import ModelConfig
from popjax.models.scan import ScannedTransformer, abstract_scanned_model, scan_layers

ATOL = 1e-5
PROMPTS = [[5, 17, 3, 99, 42, 7], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 10


def tiny_config(style: str, layers: int) -> ModelConfig:
    """d=64, 4 query heads, 2 KV heads, f=96, vocabulary 128; Qwen3 adds q/k norms."""
    fields = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=256, tie_word_embeddings=style == "qwen3")
    if style == "qwen3":
        fields.update(model_type="qwen3", qk_norm=True)
    return ModelConfig(**fields)


def random_tree(cfg: ModelConfig, seed: int = 0) -> dict:
    """A converted-checkpoint tree (HF layout: q/k/v and gate/up apart, str layer keys)."""
    rng = np.random.default_rng(seed)
    d, h = cfg.hidden_size, cfg.head_dim
    w = lambda *shape: (rng.normal(size=shape) * 0.15).astype(np.float32)
    norm = lambda n: {"weight": (1 + 0.1 * rng.normal(size=n)).astype(np.float32)}

    def layer(i):
        f = cfg.ffn_width(i)
        attn = {"q": w(cfg.q_dim, d), "k": w(cfg.kv_dim, d), "v": w(cfg.kv_dim, d), "o": w(d, cfg.q_dim)}
        if cfg.qk_norm:
            attn.update(q_norm=norm(h), k_norm=norm(h))
        return {"attn_norm": norm(d), "mlp_norm": norm(d), "attn": attn,
                "mlp": {"gate": w(f, d), "up": w(f, d), "down": w(d, f)}}

    tree = {"embed": w(cfg.vocab_size, d), "final_norm": norm(d),
            "layers": {str(i): layer(i) for i in range(cfg.num_hidden_layers)}}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = w(cfg.vocab_size, d)
    return tree


def tiny_moe_config() -> ModelConfig:
    """Qwen3-MoE: every layer routes 2 of 4 experts of width 32 (homogeneous layers)."""
    raw = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, norm_topk_prob=True, max_position_embeddings=256)
    return ModelConfig.from_hf_dict(raw)


@pytest.fixture(scope="module")
def models():
    """style -> (unrolled, scanned) LoadedModels with the same random weights."""
    from popjax.convert import convert as conv

    out = {}
    for style in ("llama", "qwen3", "qwen3-moe"):
        if style == "qwen3-moe":
            cfg = tiny_moe_config()
            rng = np.random.default_rng(0)
            shapes = conv.checkpoint_shapes(cfg).items()
            tree = conv.unflatten({k: (rng.normal(size=s) * 0.15 + (k.endswith("norm.weight"))).astype(np.float32) for k, s in shapes})
        else:
            cfg = tiny_config(style, 2)
            tree = random_tree(cfg)
        out[style] = (build_model(cfg, tree, None, style, "float32"),
                      build_model(cfg, tree, None, style, "float32", scan_layers=True))
    return out


METHODS = {
    "dense": popjax.Dense(),
    "static": popjax.Static(ratio=0.3),
    "pop-shared": popjax.POP(ratio=0.3, gamma=0.2),
    "pop-per_sequence": popjax.POP(ratio=0.3, gamma=0.2, aggregate="per_sequence"),
    "bwap": popjax.BWAP(ratio=0.3, t_init=2, t_explore=1, t_prune=3),  # pruned steps and mask updates
}
# Compiles are what this file spends its time on (~3 s of CPU per program here), so Qwen3 (which
# differs from LLaMA in attention: q/k norms, tied embeddings) runs fewer cases: forward and
# teacher forcing on Qwen3-MoE (same attention; every layer has experts, POP on each expert
# block), generation on dense Qwen3.
FORWARD_CASES = {"llama": tuple(METHODS), "qwen3-moe": ("pop-per_sequence",)}
GENERATE_CASES = [("llama", "pop-shared"), ("qwen3", "pop-per_sequence")]


def _assert_trees_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), atol=ATOL, rtol=0)


@functools.partial(jax.jit, static_argnames=("graphdef", "plans"))
def forward_and_teacher_force(graphdef, params, plans, tokens, mask, targets, data=None):
    """For every plan: ``engine.prefill``'s logits of every position [B, T, V] (what
    ``popjax.forward`` returns) and ``engine.teacher_force``'s NLL [B, N] and log-probabilities
    [B, N, V] (what ``popjax.eval`` uses), in ONE program: one compile per model instead of two
    per plan. ``data``: each plan's calibrated data (a tuple beside ``plans``; None: none)."""
    data = data or (None,) * len(plans)
    return [
        (engine.prefill(graphdef, params, tokens, mask, plan, all_logits=True, data=d)[0],
         *engine.teacher_force(graphdef, params, plan, tokens, mask, targets, with_logprobs=True, data=d)[:2])
        for plan, d in zip(plans, data)
    ]


# every method on LLaMA: ~9 s of compiles, in the full suite; the quick loop keeps Qwen3-MoE's POP
@pytest.mark.parametrize("style", [pytest.param("llama", marks=pytest.mark.slow), "qwen3-moe"])
def test_forward_and_teacher_forcing_match(models, style):
    """Logits of every prompt position, then NLL and log-probabilities of 240 targets fed through
    the decode path, for each method: the cache spans two attention blocks (512 slots, read
    block by block from the stacked cache) and BWAP's schedule runs pruned steps and updates.
    TEAL with different thresholds per layer checks that each layer gets its own index."""
    unrolled, scanned = models[style]
    names = FORWARD_CASES[style]
    plans = tuple(METHODS[name].bind(unrolled.config) for name in names)
    if style == "llama":  # a plan that picks per-layer constants by w["layer"] (traced in the scan)
        f = unrolled.config.intermediate_size
        names += ("teal-per-layer",)
        plans += (TEALPlan(f=f, n_keep=f, sparsity=0.5),)
        data = (None,) * (len(plans) - 1) + (thresholds_data({"x": (0.02, 0.6), "h": (0.3, 0.01)}),)
    else:
        data = None
    tokens, mask = pad_batch(PROMPTS, 0)
    targets = np.random.default_rng(1).integers(3, 128, size=tokens.shape[:1] + (240,))
    args = (plans, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(targets), data)
    want = forward_and_teacher_force(unrolled.graphdef, unrolled.params, *args)
    got = forward_and_teacher_force(scanned.graphdef, scanned.params, *args)
    valid = mask.astype(bool)
    for name, (logits_u, nll_u, logp_u), (logits_s, nll_s, logp_s) in zip(names, want, got):
        np.testing.assert_allclose(np.asarray(logits_s)[valid], np.asarray(logits_u)[valid], atol=ATOL, rtol=0, err_msg=name)
        np.testing.assert_allclose(np.asarray(nll_s), np.asarray(nll_u), atol=ATOL, rtol=0, err_msg=name)
        np.testing.assert_allclose(np.asarray(logp_s), np.asarray(logp_u), atol=ATOL, rtol=0, err_msg=name)


@pytest.mark.parametrize("style,name", GENERATE_CASES)
def test_generate_and_trace_match_with_one_compile_per_bucket(models, style, name):
    """Greedy tokens and the whole trace (prefill aux, method states [L, ...], per-step aux) of
    ``popjax.generate_ids`` equal the unrolled model's; a second batch of the same buckets
    compiles nothing new."""
    unrolled, scanned = models[style]
    method = METHODS[name]
    run = lambda model, prompts: popjax.generate_ids(model, prompts, NEW_TOKENS, method=method, ignore_eos=True, return_trace=True)
    other = [[9, 9, 4, 4, 120], [3, 4, 5] * 5]
    before = engine.compile_counts()
    tokens_s, trace_s = run(scanned, PROMPTS)
    first = engine.compile_counts()
    tokens_s2, trace_s2 = run(scanned, other)
    assert engine.compile_counts() == first
    assert first["start"] - before["start"] == 1 and first["decode_loop"] - before["decode_loop"] == 1
    for prompts, tokens, trace in ((PROMPTS, tokens_s, trace_s), (other, tokens_s2, trace_s2)):
        want_tokens, want_trace = run(unrolled, prompts)
        assert tokens == want_tokens and all(len(row) == NEW_TOKENS for row in tokens)
        _assert_trees_equal(trace, want_trace)
    assert jax.tree_util.tree_leaves(trace_s["partition"])[0].shape[0] == unrolled.config.num_hidden_layers


def test_stacked_layout_and_stream(models):
    """Parameters are stacked once ([L, ...] under layer_stack), the decode state holds one
    KVCache [L, B, S, n_kv, h] and states stacked [L, ...], streaming (the jitted single step)
    equals the unrolled model's tokens."""
    unrolled, scanned = models["llama"]
    pure = nnx.to_pure_dict(scanned.params)
    assert "layers" not in pure and pure["layer_stack"]["mlp"]["gate_up"].shape == (2, 2, 96, 64)
    # derived constants (‖W_d[:, j]‖₂) per layer equal the unrolled model's
    unrolled_pure = nnx.to_pure_dict(unrolled.params)
    for i in range(2):
        np.testing.assert_array_equal(pure["layer_stack"]["mlp"]["down_norm"][i], unrolled_pure["layers"][i]["mlp"]["down_norm"])
    # the same stacking from an already built unrolled model (models.scan.scan_layers)
    _assert_trees_equal(nnx.to_pure_dict(with_scanned_layers(unrolled).params), pure)
    # and back: the unrolled view that offline calibration walks (loading.unrolled)
    back = popjax.loaded.unrolled(scanned)
    assert back.graphdef == unrolled.graphdef and popjax.loaded.unrolled(unrolled) is unrolled
    _assert_trees_equal(nnx.to_pure_dict(back.params), unrolled_pure)
    method = METHODS["pop-shared"]
    req = GenerationRequest.create(scanned, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True)
    carry, _ = req.start(scanned)
    assert carry.state.caches.k.shape == (2, 2, 32 + 64, 2, 16)  # [L, B, prompt bucket + capacity, n_kv, h]
    assert all(leaf.shape[0] == 2 for leaf in jax.tree_util.tree_leaves(carry.state.method_states))
    streamed = [np.asarray(carry.token)]
    for _ in range(NEW_TOKENS - 1):  # the streaming step (popjax.stream), donating its carry
        carry, token = req.step(scanned, carry)
        streamed.append(np.asarray(token))
    want = popjax.generate_ids(unrolled, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True, return_trace=True)[0]
    assert np.stack(streamed, axis=1).tolist() == want


def test_load_with_mesh_and_scan_layers(models, tmp_path):
    """``popjax.load(converted dir, mesh=1-device mesh, scan_layers=True)`` places the stacked
    parameters in their shardings (layer axis unsplit) and generates the unrolled tokens."""
    from popjax import sharding
    from popjax.convert.store import write_converted

    cfg = tiny_config("llama", 2)
    write_converted(tmp_path / "model", cfg, random_tree(cfg), lambda _: False, {"source": "random", "kind": "hf", "dtype": "float32"})
    mesh = sharding.make_mesh((1, 1))
    scanned = popjax.load(tmp_path / "model", mesh=mesh, scan_layers=True)
    assert scanned.mesh is mesh
    gate_up = nnx.to_pure_dict(scanned.params)["layer_stack"]["mlp"]["gate_up"]
    assert gate_up.shape == (2, 2, 96, 64) and gate_up.sharding.mesh.shape == mesh.shape
    assert sharding.param_axes("layer_stack.mlp.gate_up", scanned.config) == ("layers", "mlp_pair", "mlp", "embed")
    unrolled = models["llama"][0]  # the same random weights, unsharded
    method = METHODS["pop-shared"]
    run = lambda model: popjax.generate_ids(model, PROMPTS, NEW_TOKENS, method=method, ignore_eos=True, return_trace=True)
    assert run(scanned)[0] == run(unrolled)[0]  # (the unrolled program is already compiled)


# ---------------------------------------------------------------- what a scan cannot run


def test_non_identical_layers_are_refused():
    cfg = tiny_config("llama", 3)
    with pytest.raises(ValueError, match=r"intermediate_sizes=\[64, 96, 96\].*unrolled model"):
        abstract_scanned_model(dataclasses.replace(cfg, intermediate_sizes=(64, 96, 96)))
    pruned = dataclasses.replace(cfg, intermediate_sizes=(64, 96, 96))
    unrolled = build_model(pruned, random_tree(pruned), None, "pruned", "float32")
    with pytest.raises(ValueError, match=r"intermediate_sizes=\[64, 96, 96\]"):
        with_scanned_layers(unrolled)
    from popjax.models.moe import MoEConfig

    mixed = dataclasses.replace(cfg, moe=MoEConfig(num_experts=4, top_k=2, expert_size=32, dense_size=96, sparse_layers=(0, 2)))
    with pytest.raises(ValueError, match=r"moe.sparse_layers=\[0, 2\] of 3 layers.*unrolled model"):
        abstract_scanned_model(mixed)
    # a layer with a parameter the others lack
    built = build_model(cfg, random_tree(cfg), None, "t", "float32")
    model = nnx.merge(built.graphdef, built.params)
    model.layers[1].attn.extra_kv = nnx.Param(jnp.zeros((cfg.num_key_value_heads, 2, cfg.head_dim, cfg.hidden_size)))
    with pytest.raises(ValueError, match=r"layer 1's attn.extra_kv is \(\(2, 2, 16, 64\), 'float32'\) but layer 0's is absent"):
        scan_layers(model)


def test_per_layer_steering_is_refused(models):
    _, scanned = models["llama"]
    with pytest.raises(ValueError, match=r"layer modes \('full', 'kv'\): a layer control that treats layers differently.*unrolled model"):
        popjax.generate_ids(scanned, PROMPTS, 4, method=popjax.PrefillOnly(skip=1))
    tokens, mask = pad_batch(PROMPTS, 0)
    gates = jnp.ones((2, *tokens.shape))
    with pytest.raises(ValueError, match=r"gates of shape \(2, 2, 32\).*unrolled model"):
        engine.prefill(scanned.graphdef, scanned.params, jnp.asarray(tokens), jnp.asarray(mask),
                       popjax.Dense().bind(scanned.config), all_logits=True, gates=gates)
    with pytest.raises(ValueError, match=r"the FFN hook holds 2 different per-layer functions"):
        module = nnx.merge(scanned.graphdef, scanned.params)
        fns = [lambda w, s, x, v: (x, s, {}), lambda w, s, x, v: (x, s, {})] * 2
        valid = jnp.asarray(mask, bool)
        module(ModelInputs(jnp.asarray(tokens), jnp.asarray(mask)), cache=CacheView(None, valid), ffn=FFNHook(fns[:3], None, valid))
    assert isinstance(nnx.merge(scanned.graphdef, scanned.params), ScannedTransformer)
