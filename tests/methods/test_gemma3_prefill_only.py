"""Prefill-Only Pruning and the calibrations that walk the layers, on Gemma 3, against the float64
NumPy Gemma 3 of tests/reference/gemma3.py.

* A skipped sliding layer writes only its last ``window`` prompt keys/values into its ring
  (models/decoder.py ``_bypass_cache``); the reference projects the whole prompt, and the decode
  logits agree, since no query reaches a key outside its window.
* K/V calibration (closed form and optax) and K/V drift give each layer the rotary angles of its
  kind, its attention scale and its window; the layer-importance gradients equal finite
  differences of the NumPy model.
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import engine
from popjax.analysis import layer_importance as li
from popjax.eval.kv_drift import kv_drift
from popjax.eval.teacher import teacher_forced
from popjax.requests import pad_batch
from popjax.methods.prefill_only.calibrate import calibrate_kv
from tests.conftest import random_prompts
from tests.reference.gemma3 import ATOL, SWEEP_MODEL, _ring_holds, calibration_corpus, run_reference, sweep_data
from tests.reference.lm import log_softmax


def test_prefill_only_skipped_sliding_layer_writes_its_window_into_the_ring(gemma):
    """Gemma 3 with its sliding layer 0 skipped (PrefillOnly(kv="independent"), dense FFNs):
    layer 0's ring holds K = RoPE_local(k_norm(attn_norm(x) W_k)), V = attn_norm(x) W_v of the
    last window of prompt tokens (x: the embeddings, which a skipped first layer passes on), at
    slot index mod R; the boundary and decode log-probabilities equal a reference that projects
    K/V for the whole prompt (keys outside the window are never read), and differ from dense."""
    model, _, ref = gemma("gemma3-window")
    rng = np.random.default_rng(11)
    prompts = random_prompts(rng, (12, 5), model.config.vocab_size)  # window 8: longer and shorter
    targets = np.asarray(random_prompts(rng, [4, 4], model.config.vocab_size))
    method = popjax.PrefillOnly(skip=[0], kv="independent")
    tokens, mask = pad_batch(prompts, 0)
    T = tokens.shape[1]
    _, caches, _, _ = engine.prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), method.bind(model.config))
    assert caches[0].k.shape[1] == ref.sliding_window < T
    want, ref_caches = run_reference(ref, prompts, targets, skip=(0,))
    compared = 0
    for row, ids in enumerate(prompts):
        k, v = ref_caches[row][0]  # keys/values of every prompt and target token
        compared += _ring_holds(caches[0].k, k, row, len(ids), T) + _ring_holds(caches[0].v, v, row, len(ids), T)
    assert compared == 2 * (8 + 5)
    _, logp = teacher_forced(model, method, prompts, targets, with_logprobs=True)
    np.testing.assert_allclose(logp, want, atol=ATOL, rtol=0)
    dense, _ = run_reference(ref, prompts, targets)
    assert np.abs(dense - want).max() > 1e-2  # skipping layer 0 in prefill matters


# ------------------------------------------------------------------ calibrations that walk the layers

KV_SKIP = (1, 2)  # a full and a sliding layer; the stream reaching them passed the sliding layer 0


def _streams(ref, windows):
    """(x_skip, x_full) per skipped layer of KV_SKIP [n, T, d]: with layers 1 and 2 skipped, both
    see layer 0's output in prefill; the full model feeds layer 2 layer 1's output."""
    hs = ref.hidden_states(windows)
    return {l: (hs[KV_SKIP[0]], hs[l]) for l in KV_SKIP}


def test_kv_calibration_closed_form_on_gemma3_equals_numpy(gemma):
    """The closed form fits [W_k'; W_v'] so that attn_norm(x_skip) W'ᵀ ≈ attn_norm(x_full) Wᵀ
    (ridge toward W): equal to NumPy least squares on the reference's streams, which pass the
    sliding layer 0 with its local RoPE base and window; the calibrated prefill then writes
    RoPE(k_norm(·)) of those projections into the full layer's cache and the sliding layer's ring."""
    model, _, ref = gemma(SWEEP_MODEL)
    data, ridge, d = calibration_corpus(8), 0.3, ref.d
    cal = calibrate_kv(model, skip=list(KV_SKIP), prompts=data, ridge=ridge, cache=False)
    for l, (x_skip, x_full) in _streams(ref, data.windows).items():
        g, w = ref.p(l, "input_layernorm.weight"), ref.kv_rows(l)
        Z, X = ref.norm(x_skip, g).reshape(-1, d), ref.norm(x_full, g).reshape(-1, d)
        root = np.sqrt(ridge * np.trace(Z.T @ Z) / d)  # ridge toward W: rows √(λs)·I with targets √(λs)·Wᵀ
        want = np.linalg.lstsq(np.concatenate([Z, root * np.eye(d)]), np.concatenate([X @ w.T, root * w.T]), rcond=None)[0].T
        np.testing.assert_allclose(cal.weights[l], want, atol=2e-4, rtol=0)
        if l != KV_SKIP[0]:  # (the first skipped layer's streams are equal: W' = W)
            assert np.abs(want - w).max() > 1e-2  # the streams differ: the fit moves the weights

    prompts, _ = sweep_data(model.config.vocab_size)
    method = popjax.PrefillOnly(skip=list(KV_SKIP), kv="calibrated", kv_calibration=cal)
    tokens, mask = pad_batch(prompts, 0)
    T = tokens.shape[1]
    _, caches, _, _ = engine.prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), method.bind(model.config),
                                     data=method.data(model))
    for row, ids in enumerate(prompts):
        n = len(ids)
        x_skip = ref.hidden_states([ids[:-1]])[KV_SKIP[0]][0]  # the prefilled tokens (the boundary runs in full)
        for l in KV_SKIP:
            k, v = ref.keys_values(l, x_skip, np.arange(n - 1), rows=np.asarray(cal.weights[l], np.float64))
            R = caches[l].k.shape[1]
            if ref.window(l) is None:  # the full layer: the prompt at its cache indices
                slots = list(range(T - n, T - 1))
            else:  # the ring: index c in slot c mod R; the last slot written holds the boundary token
                slots = [(T - n + j) % R for j in range(n - 1)][-(R - 1):]
            np.testing.assert_allclose(np.asarray(caches[l].k[row, slots]), k[-len(slots):], atol=1e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(caches[l].v[row, slots]), v[-len(slots):], atol=1e-5, rtol=0)


def _later_attention(ref, l, x_skip, x_full, P):
    """One window's attention outputs (after o_proj) [T − P, d] of tokens P..T−1 — their queries,
    keys and values from the full model — over prompt keys/values 0..P−1 projected from x_skip
    (prefill-only) and from x_full: (prefill-only, full). Causal, within the layer's window."""
    pos = np.arange(len(x_full))
    q = ref.queries(l, x_full, pos)[P:]
    outs = []
    for x_prompt in (x_skip, x_full):
        k, v = ref.keys_values(l, np.concatenate([x_prompt[:P], x_full[P:]]), pos)
        outs.append(ref.attend(l, q, pos[P:], k, v, pos))
    return outs


def test_kv_drift_and_optax_fit_on_gemma3_equal_numpy(gemma):
    """K/V drift (keys with each layer's RoPE and k_norm, values, and the later queries' attention
    output with the layer's scale and window) per skipped layer equals NumPy cosines; the optax
    fit's starting loss is the NumPy relative error of those attention outputs. Queries past the
    sliding layer's window see no prompt key there: the window is what makes its drift small."""
    model, _, ref = gemma(SWEEP_MODEL)
    data, P = calibration_corpus(4, window=16, seed=3), 8
    report = kv_drift(model, list(KV_SKIP), prompts=data, prefix=P)
    cal = calibrate_kv(model, skip=list(KV_SKIP), prompts=data, method="optax", steps=2, batch_size=4, cache=False)
    cos = lambda a, b: np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    flat = lambda a: a.reshape(len(a), -1)
    losses = []
    for i, (l, (x_skip, x_full)) in enumerate(_streams(ref, data.windows).items()):
        want = {"hidden": [], "k": [], "v": [], "attn": []}
        err = norm = 0.0
        for row in range(len(data.windows)):
            ks, vs = ref.keys_values(l, x_skip[row][:P], np.arange(P))
            kf, vf = ref.keys_values(l, x_full[row][:P], np.arange(P))
            want["hidden"].append(cos(x_skip[row][:P], x_full[row][:P]))
            want["k"].append(cos(flat(ks), flat(kf)))
            want["v"].append(cos(flat(vs), flat(vf)))
            out_skip, out_full = _later_attention(ref, l, x_skip[row], x_full[row], P)
            want["attn"].append(cos(out_skip, out_full))
            err, norm = err + np.sum((out_skip - out_full) ** 2), norm + np.sum(out_full**2)
        for quantity, values in want.items():
            np.testing.assert_allclose(report[quantity][i], np.mean(values), atol=1e-5, rtol=0, err_msg=f"{quantity} {l}")
        losses.append(err / norm)
    np.testing.assert_allclose(cal.fit["loss_before"], np.mean(losses), rtol=1e-3)
    assert all(np.isfinite(cal.fit["loss"]))
    assert report["attn"][0] == pytest.approx(1.0) and report["attn"][1] < 0.999  # the first skipped layer does not drift


def test_layer_importance_on_gemma3(gemma):
    """Virtual-gate gradients of the response loss on Gemma 3 (gates after the sandwich norms)
    equal central differences of the NumPy model's loss; the analysis itself runs on prompts
    longer than the window, and on the scanned model (through its unrolled view) gives the same."""
    model, scanned, ref = gemma(SWEEP_MODEL)
    rng = np.random.default_rng(2)
    prompts = random_prompts(rng, (11, 8), model.config.vocab_size)
    responses = random_prompts(rng, (5, 3), model.config.vocab_size)
    arrays = li.batch_arrays(prompts, responses, 2, boundary=False)
    plan = popjax.Dense().bind(model.config)
    loss, gp, gd = (np.asarray(a) for a in li.gate_gradients(model.graphdef, model.params, plan,
                                                              **{k: jnp.asarray(v) for k, v in arrays.items()}))

    def ref_loss(row, g_prefill, g_decode):
        seq, n_prompt = prompts[row] + responses[row], len(prompts[row])
        gates = [np.where(np.arange(len(seq)) < n_prompt, g_prefill[l], g_decode[l]) for l in range(ref.L)]
        logp = log_softmax(ref.forward([seq], ref.empty_caches(1), gates=[gates])[0])
        return -np.mean([logp[j - 1, seq[j]] for j in range(n_prompt, len(seq))])

    ones, eps = np.ones(ref.L), 1e-4
    for row in range(2):
        np.testing.assert_allclose(loss[row], ref_loss(row, ones, ones), rtol=1e-5)
        for l in range(ref.L):
            bump = np.eye(ref.L)[l] * eps
            fd_p = (ref_loss(row, ones + bump, ones) - ref_loss(row, ones - bump, ones)) / (2 * eps)
            fd_d = (ref_loss(row, ones, ones + bump) - ref_loss(row, ones, ones - bump)) / (2 * eps)
            np.testing.assert_allclose([gp[row, l], gd[row, l]], [fd_p, fd_d], rtol=2e-3, atol=2e-6, err_msg=f"row {row} layer {l}")
    result = li.layer_importance(model, prompts, response_tokens=4, batch_size=2, progress=False)
    assert result.prefill.shape == result.decode.shape == (ref.L,)
    assert np.all(np.isfinite(result.prefill)) and np.all(result.decode > 0)
    again = li.layer_importance(scanned, prompts, response_tokens=4, batch_size=2, progress=False)
    np.testing.assert_array_equal(again.prefill, result.prefill)
    np.testing.assert_array_equal(again.decode, result.decode)
