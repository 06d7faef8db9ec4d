"""POP through the whole model: ratio allocation, exactness at the edges, FLOPs, introspection, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

import popjax
from popjax.analysis.flops import analytic_ffn_flops, flops_report, xla_decode_step_flops
from popjax.eval.teacher import teacher_forced
from popjax.methods import MethodError, ffn_ratio, kept_channels, make_method, method_fields
from popjax.models import ModelConfig
from tests.conftest import random_prompts
from tests.reference.lm import SMOLLM2

# Real HF configs (the fields docs/methods.md §1 needs), with the paper's FFN ratios at 20% (Table 8).
REAL_CONFIGS = {
    "LLaMA-2-7B": (dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32), 29.9),
    "LLaMA-2-13B": (dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40), 29.9),
    "LLaMA-2-70B": (dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8), 24.3),
    "LLaMA-3.1-8B": (dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8), 24.8),
    "LLaMA-3.1-70B": (dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8), 24.3),
    "Qwen3-8B": (dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128), 25.6),
    "Qwen3-32B": (dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8, head_dim=128), 24.8),
}
AT_40 = {"LLaMA-2-7B": 59.8, "LLaMA-2-13B": 59.8, "LLaMA-2-70B": 48.6, "LLaMA-3.1-8B": 49.5, "LLaMA-3.1-70B": 48.6, "Qwen3-8B": 51.1, "Qwen3-32B": 49.6}
COMMON = dict(vocab_size=32000, num_hidden_layers=2, max_position_embeddings=4096)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_ffn_ratio_check_values(name):
    fields, at_20 = REAL_CONFIGS[name]
    cfg = ModelConfig.from_hf_dict({**COMMON, **fields})
    assert round(100 * ffn_ratio(cfg, 0.2), 1) == at_20
    assert round(100 * ffn_ratio(cfg, 0.4), 1) == AT_40[name]
    f = cfg.intermediate_size
    assert kept_channels(cfg, 0.2) == f - int(np.floor(ffn_ratio(cfg, 0.2) * f + 0.5))


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    directory, _ = tiny_checkpoints("llama-gqa")
    return popjax.load(directory, cache=False)


def _teacher_forced_logits(model, method, prompts, continuations):
    """Prefill + decode steps fed the given tokens -> log-probabilities [B, steps, V]."""
    return teacher_forced(model, method, prompts, np.asarray(continuations), with_logprobs=True)[1]


def _data(model, seed=0):
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    return random_prompts(rng, (4, 11, 7), vocab), random_prompts(rng, (6, 6, 6), vocab)


@pytest.mark.parametrize("method", [popjax.POP(ratio=0.0), popjax.Static(ratio=0.0), popjax.Dynamic(ratio=0.0)])
def test_ratio_zero_is_exactly_dense(tiny_model, method):
    prompts, continuations = _data(tiny_model)
    dense = _teacher_forced_logits(tiny_model, popjax.Dense(), prompts, continuations)
    np.testing.assert_array_equal(_teacher_forced_logits(tiny_model, method, prompts, continuations), dense)


@pytest.mark.parametrize("aggregate", ["shared", "per_sequence"])
def test_gamma_zero_is_exactly_static(tiny_model, aggregate):
    prompts, continuations = _data(tiny_model, seed=1)
    pop = _teacher_forced_logits(tiny_model, popjax.POP(ratio=0.3, gamma=0.0, aggregate=aggregate), prompts, continuations)
    static = _teacher_forced_logits(tiny_model, popjax.Static(ratio=0.3, aggregate=aggregate), prompts, continuations)
    np.testing.assert_array_equal(pop, static)


def test_pruned_methods_differ_and_order_as_expected(tiny_model):
    """A sanity check that pruning is applied: POP sits between static and dynamic at the same
    kept count and differs from dense."""
    prompts, continuations = _data(tiny_model, seed=2)
    dense = _teacher_forced_logits(tiny_model, popjax.Dense(), prompts, continuations)
    errors = {}
    for method in (popjax.Static(ratio=0.3), popjax.POP(ratio=0.3, gamma=0.3), popjax.Dynamic(ratio=0.3)):
        got = _teacher_forced_logits(tiny_model, method, prompts, continuations)
        np.testing.assert_array_equal(got[:, 0], _teacher_forced_logits(tiny_model, popjax.Static(ratio=0.3), prompts, continuations)[:, 0])
        errors[method.name] = float(np.abs(got[:, 1:] - dense[:, 1:]).mean())
    assert errors["dynamic"] < errors["pop"] < errors["static"]


@pytest.mark.optimized_xla  # the overhead is of the optimised programs users run
def test_xla_cost_analysis_overhead_within_four_percent():
    # SmolLM2's widths; two of its 30 layers: the overhead is a per-layer ratio, and the whole
    # model's programs take 15x longer to compile
    cfg = dataclasses.replace(ModelConfig.from_hf_dict(SMOLLM2), num_hidden_layers=2)
    dense_ffn = analytic_ffn_flops(cfg, popjax.Dense().bind(cfg))
    dense = xla_decode_step_flops(cfg, popjax.Dense())
    for ratio in (0.2, 0.4):
        pop = xla_decode_step_flops(cfg, popjax.POP(ratio=ratio, gamma=0.1))
        static = xla_decode_step_flops(cfg, popjax.Static(ratio=ratio))
        overhead = (pop - static) / dense_ffn
        assert 0 < overhead <= 0.04, overhead
        analytic = flops_report(cfg, popjax.POP(ratio=ratio, gamma=0.1))["overhead_vs_static_of_dense"]
        assert abs(overhead - analytic) < 0.005  # XLA counts what docs/methods.md §2 predicts (+ O(n_C) scoring)
        assert static < pop < dense


def test_trace_reports_partitions_and_selections(tiny_model):
    prompts, _ = _data(tiny_model, seed=3)
    method = popjax.POP(ratio=0.3, gamma=0.2, aggregate="shared")  # one partition for the batch: [L, n] entries
    plan = method.bind(tiny_model.config)
    ids, trace = popjax.generate_ids(tiny_model, prompts, max_new_tokens=6, method=method, stop_ids=[], return_trace=True)
    L = tiny_model.config.num_hidden_layers
    part = trace["partition"]
    assert part["retained_idx"].shape == (L, plan.n_retained)
    assert part["candidate_idx"].shape == (L, plan.n_candidates)
    assert trace["prefill"]["importance"].shape == (L, plan.f)
    selected, scores = trace["decode"]["selected"], trace["decode"]["scores"]
    assert selected.shape == (5, L, plan.m) and scores.shape == (5, L, plan.m)
    for layer in range(L):
        assert set(selected[:, layer].ravel()) <= set(part["candidate_idx"][layer])
    assert np.all(np.diff(scores, axis=-1) <= 0)  # top_k order
    plain, _ = popjax.generate_ids(tiny_model, prompts, max_new_tokens=6, method=method, stop_ids=[])
    assert plain == ids  # tracing does not change the result


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: popjax.POP(ratio=1.0), r"ratio=1.0 is outside \[0, 1\)"),
        (lambda: popjax.Static(ratio=-0.1), r"ratio=-0.1 is outside \[0, 1\)"),
        (lambda: popjax.POP(ratio=0.2, gamma=1.5), r"gamma=1.5 is outside \[0, 1\]"),
        (lambda: popjax.POP(ratio=0.2, gamma=-0.01), r"gamma=-0.01 is outside"),
        (lambda: popjax.POP(ratio=0.2, aggregate="mean"), r"aggregate='mean' is not one of \('shared', 'per_sequence'\)"),
        (lambda: make_method("no-such-method"), r"unknown method 'no-such-method'; valid methods: \[.*'dense', 'dynamic', .*'pop', .*'static'"),
        (lambda: make_method("static", gamma=0.1), r"method 'static' takes no \['gamma'\]"),
    ],
)
def test_bad_method_arguments(build, message):
    with pytest.raises(MethodError, match=message):
        build()


def test_ffn_ratio_reaching_one_is_an_error(tiny_model):
    with pytest.raises(MethodError, match=r"ratio=0.7 needs an FFN ratio of 1.167 ≥ 1.*below 0.600"):
        popjax.generate_ids(tiny_model, [[5, 6]], method=popjax.POP(ratio=0.7))


@pytest.mark.parametrize(
    "options",
    [dict(aggregate="shared"), dict(aggregate="per_sequence"), dict(partition="per_shard", shards=4)],
    ids=["shared", "per_sequence", "per_shard"],
)
def test_gather_weights_equal_compact_copies(tiny_model, options):
    """weights="gather" reads the same rows from the model's weights every step instead of from
    the prefill's copy: same log-probabilities, and a state that holds channel ids only."""
    prompts, continuations = _data(tiny_model, seed=4)
    compact = popjax.POP(ratio=0.3, gamma=0.3, **options)
    gather = popjax.POP(ratio=0.3, gamma=0.3, weights="gather", **options)
    np.testing.assert_allclose(
        _teacher_forced_logits(tiny_model, gather, prompts, continuations),
        _teacher_forced_logits(tiny_model, compact, prompts, continuations), atol=1e-6,
    )
    plan = gather.bind(tiny_model.config)
    assert plan.compact_weights is False and compact.bind(tiny_model.config).compact_weights is True
    x = np.zeros((2, 3, tiny_model.config.hidden_size), np.float32)
    w = nnx.merge(tiny_model.graphdef, tiny_model.params).layers[0].mlp.ffn_weights(0)
    _, state, _ = plan.prefill(w, x, np.ones((2, 3), bool))
    assert sorted(state) == ["candidate_idx", "down_norm_candidates", "retained_idx"]


def test_gather_weights_errors():
    with pytest.raises(MethodError, match=r"weights='copy' is not one of \('compact', 'gather'\)"):
        popjax.POP(ratio=0.2, weights="copy")
    # the other POP presets have no weights option (no option accepted and then refused)
    assert "weights" not in method_fields("pop-gate")
    with pytest.raises(MethodError, match="weights"):
        make_method("pop-gate", ratio=0.2, weights="gather")
