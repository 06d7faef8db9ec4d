"""Every pruning method on Gemma 3 (GeGLU FFN, sliding-window layers with ring-buffer caches,
sandwich norms, soft-capped logits), against plain NumPy references where the method's math
depends on the architecture (the float64 `RefGemma3` of tests/reference/gemma3.py).

* POP, GRIFFIN, CATS (calibrated: its thresholds are quantiles of |gelu(x W_g)|) through the
  engine equal their NumPy references: partitions, importances, selections, logits.
* Every registered method runs on the tiny Gemma 3 (prompts longer than the window), and some
  int8 and scanned, in tests/methods/test_method_matrix.py.
* Prefill-Only + POP skipping both sliding layers equals the reference (rings, partitions built
  from the boundary token, selections, logits). Prefill-Only's own checks and the calibrations
  that walk the layers are in tests/methods/test_gemma3_prefill_only.py.

Compiles are what this file spends its time on, so the four referenced methods run in ONE
program (`run_all`: each plan's teacher-forced decode steps after its prefill, plus the prefill
outputs the references read), and the references compare against those very results.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from popjax import engine
from popjax.requests import pad_batch
from tests.reference.ffn import ref_gate, ref_sizes, silu
from tests.reference.gemma3 import ATOL, N_TARGETS, RefCATS, RefGRIFFIN, RefPOP, SKIP, SWEEP_MODEL, _ring_holds, calibration_corpus, run_reference, sweep_data
from tests.reference.matrix import ready as ready_method


@pytest.fixture(scope="module")
def ready(gemma):
    """name -> the registered method ready for the sweep model (memoised, as the method matrix
    readies it: prefill-only skips both sliding layers, their POP states from the boundary token).
    The NumPy references implement one selection per batch: POP, GRIFFIN and Prefill-Only run it."""
    model, _, _ = gemma(SWEEP_MODEL)
    cache = {}

    def get(name):
        if name not in cache:
            shared = {"aggregate": "shared"} if name in ("pop", "griffin", "prefill-only") else {}
            cache[name] = ready_method(name, "gemma3", model, **shared)
        return cache[name]

    return get


# the methods whose prefill outputs (caches, partitions, importances) the references read
PREFILL_OUTPUTS = ("pop", "prefill-only")
REFERENCED = ("pop", "griffin", "cats", "prefill-only")  # the methods with a NumPy reference below


@functools.partial(jax.jit, static_argnames=("graphdef", "plans", "with_prefill"))
def run_all(graphdef, params, plans, tokens, mask, targets, data, with_prefill):
    """For every plan, in one program: ``engine.teacher_force``'s log-probabilities [B, N, V] and
    recorded selections ([N, L, m]; none for a method without) of the targets fed one at a time
    after the prompt's prefill and, where ``with_prefill`` says, ``engine.prefill``'s caches,
    method states and aux (for a plan with a boundary: after the boundary step). ``data``: each
    plan's calibrated data (`Method.data`)."""
    out = []
    for plan, d, prefill in zip(plans, data, with_prefill):
        _, logp, records = engine.teacher_force(graphdef, params, plan, tokens, mask, targets, with_logprobs=True,
                                                record=("selected",), data=d)
        out.append({"logp": logp, "records": records})
        if prefill:
            _, caches, states, aux = engine.prefill(graphdef, params, tokens, mask, plan, with_aux=True, data=d)
            out[-1].update(caches=caches, states=states, aux=aux)
    return out


@pytest.fixture(scope="module")
def sweep(gemma, ready):
    """name -> {"unrolled": run_all's results} for each method a reference below reads."""
    model, _, _ = gemma(SWEEP_MODEL)
    prompts, targets = sweep_data(model.config.vocab_size)
    tokens, mask = pad_batch(prompts, 0)
    args = (jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(targets))
    names = REFERENCED
    plans = tuple(ready(n).bind(model.config) for n in names)
    data = tuple(ready(n).data(model) for n in names)
    with_prefill = tuple(n in PREFILL_OUTPUTS for n in names)
    results = jax.device_get(run_all(model.graphdef, model.params, plans, *args, data, with_prefill))
    return {name: {"unrolled": result} for name, result in zip(names, results)}


# ------------------------------------------------------------------ the reference itself


@pytest.mark.parametrize("name", ["gemma3-window", SWEEP_MODEL])
def test_numpy_reference_equals_transformers(gemma, tiny_checkpoints, name):
    """The reference's dense logits are transformers' (every later comparison rests on it); and
    its FFN is GeGLU: with SiLU in its place the logits move."""
    _, hf = tiny_checkpoints(name)
    _, _, ref = gemma(name)
    prompts, _ = sweep_data(ref.sd["model.embed_tokens.weight"].shape[0])
    for ids in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].double().numpy()
        got = ref.forward([ids], ref.empty_caches(1))[0]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
        swiglu = lambda l, X, valid: (silu(X @ ref.W[l]["gate"]) * (X @ ref.W[l]["up"])) @ ref.W[l]["down"]
        assert np.abs(ref.forward([ids], ref.empty_caches(1), swiglu)[0] - want).max() > 1e-2


# ------------------------------------------------------------------ methods vs their references


def _assert_partition(state, importance, pop, l):
    """Layer l's POP partition and importance. R and C are compared as channel sets, what POP
    computes with: through a whole fp32 model two nearly tied channels inside R (relative gap
    ~1e-5 here) may swap places against float64, which no output sees."""
    R, C = pop.state[l]
    assert sorted(np.asarray(state["retained_idx"]).tolist()) == sorted(R)
    assert sorted(np.asarray(state["candidate_idx"]).tolist()) == sorted(C)
    np.testing.assert_allclose(np.asarray(importance), pop.aux[l], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # one program of the four referenced methods
def test_pop_on_gemma3_matches_the_numpy_reference(gemma, ready, sweep):
    """POP (shared): each layer's partition R/C and importance from the prompts (padding
    excluded), the log-probabilities of the prompt's last token and of every decode step, and
    each step's selection, as in tests/methods/test_methods_reference.py, on the whole Gemma model."""
    model, _, ref = gemma(SWEEP_MODEL)
    method = ready("pop")
    assert method.aggregate == "shared"  # what RefPOP implements
    plan = method.bind(model.config)
    assert (plan.n_retained, plan.n_candidates, plan.m) == ref_sizes(plan.f, plan.n_keep, method.gamma)
    prompts, targets = sweep_data(model.config.vocab_size)
    got = sweep["pop"]["unrolled"]
    states, aux, logp, records = got["states"], got["aux"], got["logp"], got["records"]
    pop = RefPOP(ref, plan.n_keep, plan.m)
    want, _ = run_reference(ref, prompts, targets, pop)
    for l in range(ref.L):
        _assert_partition(states[l], aux["importance"][l], pop, l)
        assert [sorted(step) for step in records["selected"][:, l].tolist()] == [sorted(step) for step in pop.steps[l]]
    np.testing.assert_allclose(logp, want, atol=ATOL, rtol=0)


@pytest.mark.slow  # one program of the four referenced methods
@pytest.mark.parametrize("name", ["griffin", "cats"])
def test_activation_scored_baselines_on_gemma3_match_the_numpy_references(gemma, ready, sweep, name):
    """GRIFFIN (GeGLU activations normalised per token rank the channels) and CATS (calibrated
    thresholds on |gelu(x W_g)|): the teacher-forced log-probabilities equal the references'."""
    model, _, ref = gemma(SWEEP_MODEL)
    method = ready(name)
    plan = method.bind(model.config)
    prompts, targets = sweep_data(model.config.vocab_size)
    if name == "griffin":
        assert method.aggregate == "shared"
        ffn = RefGRIFFIN(ref, plan.n_keep)
    else:
        assert method.aggregate == "max"
        ffn = RefCATS(ref, method.thresholds.get("gate"))
    logp = sweep[name]["unrolled"]["logp"]
    want, _ = run_reference(ref, prompts, targets, ffn)
    np.testing.assert_allclose(logp, want, atol=ATOL, rtol=0)
    if name == "cats":  # the thresholds bite: some channels are zeroed, not all
        kept = np.array([step.mean() for l in range(ref.L) for step in ffn.steps[l]])
        assert kept.min() < 1.0 and kept.max() > 0.0


def test_cats_thresholds_are_quantiles_of_the_gelu_gate(gemma, ready):
    """CATS's calibration collects |act(x W_g)| with the model's GeGLU gate: each layer's
    threshold is the NumPy quantile, at the target sparsity, of |gelu(x W_g)| over the corpus
    (within the log histogram's bin width), and not that of |silu(x W_g)|."""
    model, _, ref = gemma(SWEEP_MODEL)
    method = ready("cats")
    s = method.sparsity(model.config)
    inputs = []
    capture = lambda l, X, valid: (inputs.append(X[valid]), ref.dense(l, X, valid))[1]
    ref.forward([list(w) for w in calibration_corpus().windows], ref.empty_caches(6), capture)
    for l, t in enumerate(method.thresholds.get("gate")):
        np.testing.assert_allclose(t, np.quantile(np.abs(ref_gate(ref.W[l], inputs[l])), s), rtol=1e-2)
        assert abs(t / np.quantile(np.abs(silu(inputs[l] @ ref.W[l]["gate"])), s) - 1) > 0.03


# ------------------------------------------------------------------ Prefill-Only + POP


@pytest.mark.slow  # one program of the four referenced methods
def test_prefill_only_with_pop_on_gemma3_matches_the_numpy_reference(gemma, ready, sweep):
    """The sweep's PrefillOnly(skip both sliding layers) + POP: the skipped layers' rings hold the
    independent K/V of their last window of prompt tokens (layer 2's input: the full layer 1's
    output on a stream that skipped layer 0), their POP partitions come from the boundary token,
    the full layer's from the prompt; log-probabilities and selections equal the reference's."""
    model, _, ref = gemma(SWEEP_MODEL)
    method = ready("prefill-only")
    plan = method.bind(model.config)
    assert plan.skipped == SKIP
    prompts, targets = sweep_data(model.config.vocab_size)
    tokens, mask = pad_batch(prompts, 0)
    T = tokens.shape[1]
    got = sweep["prefill-only"]["unrolled"]
    caches, states, aux, logp, records = got["caches"], got["states"], got["aux"], got["logp"], got["records"]
    pop = RefPOP(ref, plan.mlp.n_keep, plan.mlp.m)
    want, ref_caches = run_reference(ref, prompts, targets, pop, skip=SKIP)
    for l in SKIP:
        for row, ids in enumerate(prompts):
            assert _ring_holds(caches[l].k, ref_caches[row][l][0], row, len(ids), T) == ref.sliding_window
            _ring_holds(caches[l].v, ref_caches[row][l][1], row, len(ids), T)
    for l in range(ref.L):
        _assert_partition(states[l], aux["importance"][l], pop, l)
        want_steps = pop.steps[l][-N_TARGETS:]  # (the boundary step is prefill's)
        assert [sorted(step) for step in records["selected"][:, l].tolist()] == [sorted(step) for step in want_steps]
    np.testing.assert_allclose(logp, want, atol=ATOL, rtol=0)
