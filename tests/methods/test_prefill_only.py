"""Prefill-Only Pruning (docs/methods.md §4) against a plain NumPy decoder on a tiny random LLaMA.

The reference takes its weights from the transformers model (not from popjax), projects the
skipped layers' keys/values from their input residual stream, and runs the boundary token
through every layer from the prefilled caches."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import popjax
from popjax import engine
from popjax.eval.teacher import teacher_forced
from popjax.requests import pad_batch
from popjax.methods import MethodError, make_method
from tests.conftest import random_prompts

ATOL = 1e-4


# ------------------------------------------------------------------ the NumPy reference


def weights_of(hf) -> dict:
    sd = {k: v.double().numpy() for k, v in hf.state_dict().items()}
    cfg = hf.config
    return {"sd": sd, "heads": cfg.num_attention_heads, "kv": cfg.num_key_value_heads,
            "h": cfg.hidden_size // cfg.num_attention_heads, "eps": cfg.rms_norm_eps,
            "theta": (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0),
            "layers": cfg.num_hidden_layers}


def rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, pos, h, theta):
    """x [n, h] at position pos (HF half-split rotation)."""
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-x[:, h // 2 :], x[:, : h // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def ref_kv(W, layer, x, pos):
    """The layer's key (RoPE'd) and value for residual input x [d] at position pos -> [kv, h] each."""
    p = f"model.layers.{layer}."
    xn = rms(x, W["sd"][p + "input_layernorm.weight"], W["eps"])
    k = (W["sd"][p + "self_attn.k_proj.weight"] @ xn).reshape(W["kv"], W["h"])
    v = (W["sd"][p + "self_attn.v_proj.weight"] @ xn).reshape(W["kv"], W["h"])
    return rope(k, pos, W["h"], W["theta"]), v


def ref_boundary_logits(W, token, pos, keys, values, visible):
    """One full-model step for ``token`` at ``pos`` attending to cached keys/values
    (per layer lists of [kv, h] arrays) where ``visible[layer][i]`` -> logits [V]."""
    sd, g = W["sd"], W["heads"] // W["kv"]
    x = sd["model.embed_tokens.weight"][token]
    for layer in range(W["layers"]):
        p = f"model.layers.{layer}."
        xn = rms(x, sd[p + "input_layernorm.weight"], W["eps"])
        q = rope((sd[p + "self_attn.q_proj.weight"] @ xn).reshape(W["heads"], W["h"]), pos, W["h"], W["theta"])
        k_new, v_new = ref_kv(W, layer, x, pos)
        K = [k for k, ok in zip(keys[layer], visible[layer]) if ok] + [k_new]
        V = [v for v, ok in zip(values[layer], visible[layer]) if ok] + [v_new]
        out = np.zeros((W["heads"], W["h"]))
        for head in range(W["heads"]):
            s = np.array([q[head] @ k[head // g] for k in K]) / np.sqrt(W["h"])
            a = np.exp(s - s.max())
            out[head] = (a / a.sum()) @ np.array([v[head // g] for v in V])
        x = x + sd[p + "self_attn.o_proj.weight"] @ out.reshape(-1)
        xn = rms(x, sd[p + "post_attention_layernorm.weight"], W["eps"])
        gate, up = sd[p + "mlp.gate_proj.weight"] @ xn, sd[p + "mlp.up_proj.weight"] @ xn
        x = x + sd[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)
    x = rms(x, sd["model.norm.weight"], W["eps"])
    return sd["lm_head.weight"] @ x


def hidden_before(hf, ids: list[int], layer: int) -> np.ndarray:
    """Residual stream entering ``layer`` for every token of ``ids`` (full model on ids) [n, d]."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[layer][0].double().numpy()


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    directory, hf = tiny_checkpoints("llama-gqa")
    return popjax.load(directory, cache=False), hf


@pytest.mark.parametrize("kv", ["independent", "none"])
def test_caches_and_boundary_logits_match_the_numpy_reference(tiny, kv):
    model, hf = tiny
    W = weights_of(hf)
    prompts = random_prompts(np.random.default_rng(0), [6, 11], model.config.vocab_size)
    method = popjax.PrefillOnly(skip=[1], kv=kv)
    tokens, mask = pad_batch(prompts, 0)
    T = tokens.shape[1]
    logits, caches, _, _ = engine.prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), method.bind(model.config))
    logits = np.asarray(logits)
    for row, ids in enumerate(prompts):
        n = len(ids)
        slots = range(T - n, T - 1)  # the prefilled tokens 1..N−1 (the boundary slot is T − 1)
        # skipped layer 1: input = layer 0's output on tokens 1..N−1 (layer 0 is causal, so the
        # full model's hidden state at those positions is the same)
        x_in = hidden_before(hf, ids[:-1], 1)
        keys, values, visible = [[], []], [[], []], [[], []]
        for pos, slot in enumerate(slots):
            k_ref, v_ref = ref_kv(W, 1, x_in[pos], pos)
            k_got, v_got = np.asarray(caches[1].k[row, slot]), np.asarray(caches[1].v[row, slot])
            if kv == "independent":
                np.testing.assert_allclose(k_got, k_ref, atol=1e-5, rtol=0)
                np.testing.assert_allclose(v_got, v_ref, atol=1e-5, rtol=0)
            else:
                assert not k_got.any() and not v_got.any()
            for layer in (0, 1):
                keys[layer].append(np.asarray(caches[layer].k[row, slot], np.float64))
                values[layer].append(np.asarray(caches[layer].v[row, slot], np.float64))
                visible[layer].append(layer == 0 or kv == "independent")
        want = ref_boundary_logits(W, ids[-1], n - 1, keys, values, visible)
        np.testing.assert_allclose(logits[row], want, atol=ATOL, rtol=0)


def test_no_skipped_layer_is_exactly_dense(tiny):
    model, _ = tiny
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, [5, 9], model.config.vocab_size)
    targets = np.asarray(random_prompts(rng, [6, 6], model.config.vocab_size))
    for method in (popjax.PrefillOnly(skip=[]), popjax.PrefillOnly(skip=0), popjax.PrefillOnly(skip=0.0)):
        assert method.bind(model.config) == popjax.Dense().bind(model.config)
    dense = teacher_forced(model, popjax.Dense(), prompts, targets, with_logprobs=True)[1]
    got = teacher_forced(model, popjax.PrefillOnly(skip=[]), prompts, targets, with_logprobs=True)[1]
    np.testing.assert_array_equal(got, dense)


def test_one_token_prompt_equals_dense(tiny):
    """The boundary step processes the only token with the full model: nothing is skipped."""
    model, _ = tiny
    prompt = [[7]]
    dense, _ = popjax.generate_ids(model, prompt, 8, stop_ids=[])
    got, _ = popjax.generate_ids(model, prompt, 8, method=popjax.PrefillOnly(skip=[1]), stop_ids=[])
    assert got == dense


def test_skipping_changes_generation_and_decode_uses_every_layer(tiny):
    model, _ = tiny
    rng = np.random.default_rng(2)
    prompts = random_prompts(rng, [14, 20], model.config.vocab_size)
    targets = np.asarray(random_prompts(rng, [5, 5], model.config.vocab_size))
    nll = lambda method: teacher_forced(model, method, prompts, targets)[0]
    dense = nll(popjax.Dense())
    # the last layer's input does not depend on the last layer: skipping it alone loses nothing
    np.testing.assert_allclose(nll(popjax.PrefillOnly(skip=[1])), dense, atol=1e-5)
    assert not np.allclose(nll(popjax.PrefillOnly(skip=[0])), dense, atol=1e-3)
    # without the boundary, the first prediction comes from the pruned pass
    assert not np.allclose(nll(popjax.PrefillOnly(skip=[1], boundary=False)), dense, atol=1e-3)


def test_composes_with_pop_and_traces_every_layer(tiny):
    model, _ = tiny
    prompts = random_prompts(np.random.default_rng(3), [9, 12], model.config.vocab_size)
    method = popjax.PrefillOnly(skip=[1]) + popjax.POP(ratio=0.3, gamma=0.2, aggregate="shared")
    assert make_method("prefill-only+pop", skip=[1], ratio=0.3, gamma=0.2, aggregate="shared") == method
    ids, trace = popjax.generate_ids(model, prompts, 6, method=method, stop_ids=[], return_trace=True)
    plan = popjax.POP(ratio=0.3, gamma=0.2, aggregate="shared").bind(model.config)
    assert trace["partition"]["candidate_idx"].shape == (2, plan.n_candidates)
    # the skipped layer's prefill importance comes from the boundary token alone
    assert (trace["prefill"]["importance"][1] > 0).any()
    assert trace["decode"]["selected"].shape == (5, 2, plan.m)
    plain, _ = popjax.generate_ids(model, prompts, 6, method=method, stop_ids=[])
    assert plain == ids


def test_least_important_layers_from_the_analysis():
    from popjax.analysis.layer_importance import LayerImportance

    result = LayerImportance(np.array([5.0, 0.1, 3.0, 0.2]), np.ones(4), n_samples=1, response_tokens=4,
                             boundary=True, mean_prompt_tokens=8.0, mean_response_tokens=4.0)
    assert popjax.PrefillOnly.least_important(result, 2, kv="none") == popjax.PrefillOnly(skip=[1, 3], kv="none")


def test_prompts_of_one_bucket_compile_once(tiny):
    model, _ = tiny
    method = popjax.PrefillOnly(skip=[1]) + popjax.Static(ratio=0.3)
    prompts = random_prompts(np.random.default_rng(4), [3, 8, 17, 30], model.config.vocab_size)
    popjax.generate_ids(model, [prompts[0]], 4, method=method)
    before = engine.compile_counts()
    for prompt in prompts[1:]:
        popjax.generate_ids(model, [prompt], 6, method=method)
    assert engine.compile_counts() == before


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: popjax.PrefillOnly(skip=[0, 0]), r"skip=\[0, 0\] names a layer twice"),
        (lambda: popjax.PrefillOnly(skip=1.0), r"skip=1.0 is a fraction outside \[0, 1\)"),
        (lambda: popjax.PrefillOnly(skip=-0.5), r"skip=-0.5 is a fraction outside"),
        (lambda: popjax.PrefillOnly(skip=-2), r"skip=-2 is negative"),
        (lambda: popjax.PrefillOnly(skip=True), r"skip=True is invalid"),
        (lambda: popjax.PrefillOnly(kv="fitted"), r"kv='fitted' is not one of \('independent', .*'none'\)"),
        (lambda: make_method("pop+prefill-only"), r"'pop' is not a layer-level method"),
    ],
)
def test_bad_arguments(build, message):
    with pytest.raises(MethodError, match=message):
        build()


@pytest.mark.parametrize(
    "method, message",
    [
        (popjax.PrefillOnly(skip=[2]), r"skip holds layers \[2\] outside \[0, 2\)"),
        (popjax.PrefillOnly(skip=[0, 1]), r"skips all 2 layers"),
        (popjax.PrefillOnly(skip=2), r"skip=2 skips all 2 layers"),
        (popjax.PrefillOnly(skip=[1], boundary=False) + popjax.POP(0.3), r"boundary=False\) cannot be combined with pop"),
    ],
)
def test_bad_skip_sets_for_the_model(tiny, method, message):
    model, _ = tiny
    with pytest.raises(MethodError, match=message):
        popjax.generate_ids(model, [[5, 6, 7]], 2, method=method)
