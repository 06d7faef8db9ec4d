"""Virtual-gate layer importance (docs/methods.md §9): exact gates, correct gradients, response-only loss,
per-sample squares, one compile per shape, and the report/CLI around it."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax import engine
from popjax.analysis import layer_importance as li
from popjax.cli import analyze_layers as analyze_layers_command
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def plan(tiny_model):
    return popjax.Dense().bind(tiny_model.config)


def _rows(model, lengths, response_lengths, seed=0):
    """Random prompts and responses (token ids) of the given lengths."""
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, lengths, model.config.vocab_size)
    responses = random_prompts(rng, response_lengths, model.config.vocab_size)
    return prompts, responses


def _grads(model, plan, arrays):
    out = li.gate_gradients(model.graphdef, model.params, plan, **{k: jnp.asarray(v) for k, v in arrays.items()})
    return [np.asarray(a) for a in out]


def _reference_loss(model, plan, arrays, row, n_response, g_prefill, g_decode):
    """Mean NLL (float64, NumPy) of the last ``n_response`` tokens of row ``row`` (its response)
    under the gates g_prefill on its prompt tokens and g_decode on the rest, [L] each."""
    is_prompt = arrays["is_prompt"]
    gates = np.where(is_prompt[None], np.asarray(g_prefill)[:, None, None], np.asarray(g_decode)[:, None, None])
    logits, _, _, _ = engine.prefill(
        model.graphdef, model.params, jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["mask"]), plan,
        all_logits=True, gates=jnp.asarray(gates, jnp.float32),
    )
    logits = np.asarray(logits[row], np.float64)
    tokens, T = arrays["tokens"][row], logits.shape[0]
    nll = []
    for j in range(T - n_response, T):  # logits at j - 1 predict token j
        z = logits[j - 1] - logits[j - 1].max()
        nll.append(np.log(np.exp(z).sum()) - z[tokens[j]])
    return float(np.mean(nll))


def test_gates_at_one_leave_logits_bit_identical(tiny_model, plan):
    prompts, _ = _rows(tiny_model, [5, 12, 20], [1, 1, 1])
    arrays = li.batch_arrays(prompts, [[] for _ in prompts], 3, boundary=False)
    tokens, mask = jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["mask"])
    L = tiny_model.config.num_hidden_layers
    plain = engine.prefill(tiny_model.graphdef, tiny_model.params, tokens, mask, plan, all_logits=True)[0]
    gated = engine.prefill(
        tiny_model.graphdef, tiny_model.params, tokens, mask, plan, all_logits=True, gates=jnp.ones((L, *tokens.shape))
    )[0]
    assert np.array_equal(np.asarray(plain), np.asarray(gated))


def test_batch_arrays_layout():
    arrays = li.batch_arrays([[5, 6, 7]], [[8, 9]], batch_size=2, boundary=False)
    T = arrays["tokens"].shape[1]
    assert T == li.LENGTH_BUCKETS[0]
    np.testing.assert_array_equal(arrays["tokens"][0, -5:], [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(arrays["is_prompt"][0, -5:], [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(arrays["targets"][0, -5:], [6, 7, 8, 9, 0])
    np.testing.assert_array_equal(arrays["loss_mask"][0, -6:], [0, 0, 0, 1, 1, 0])  # predicting 8 and 9
    assert not arrays["mask"][1].any() and not arrays["loss_mask"][1].any()  # the empty row
    with_boundary = li.batch_arrays([[5, 6, 7]], [[8, 9]], batch_size=1, boundary=True)
    np.testing.assert_array_equal(with_boundary["is_prompt"][0, -5:], [1, 1, 0, 0, 0])


@pytest.mark.parametrize("boundary", [False, True])
def test_loss_and_gate_gradients_match_reference_and_finite_differences(tiny_model, plan, boundary):
    prompts, responses = _rows(tiny_model, [9, 14], [6, 3], seed=1)
    arrays = li.batch_arrays(prompts, responses, 2, boundary=boundary)
    loss, gp, gd = _grads(tiny_model, plan, arrays)
    L = tiny_model.config.num_hidden_layers
    ones = np.ones(L)
    for row in range(2):
        reference = _reference_loss(tiny_model, plan, arrays, row, len(responses[row]), ones, ones)
        np.testing.assert_allclose(loss[row], reference, rtol=1e-5)
    eps = 1e-2
    for row in range(2):
        for l in range(L):
            for phase, grad in (("prefill", gp), ("decode", gd)):
                bump = np.eye(L)[l] * eps
                args = lambda sign: (ones + sign * bump, ones) if phase == "prefill" else (ones, ones + sign * bump)
                n = len(responses[row])
                fd = (_reference_loss(tiny_model, plan, arrays, row, n, *args(+1))
                      - _reference_loss(tiny_model, plan, arrays, row, n, *args(-1))) / (2 * eps)
                np.testing.assert_allclose(grad[row, l], fd, rtol=1e-2, atol=2e-4, err_msg=f"{phase} {row} {l}")
    # The last layer's prompt outputs reach the loss only through the last prompt token's logits;
    # with the boundary that token is a decode token, so the gradient is exactly zero.
    assert (gp[:, L - 1] == 0).all() if boundary else (gp[:, L - 1] != 0).all()
    assert (gd != 0).all()


def test_loss_is_response_only(tiny_model, plan):
    prompts, responses = _rows(tiny_model, [10], [5], seed=2)
    arrays = li.batch_arrays(prompts, responses, 1, boundary=False)
    base = _grads(tiny_model, plan, arrays)
    T = arrays["tokens"].shape[1]
    prompt_position = T - 1 - 5 - 3  # predicts a prompt token: outside the loss
    assert arrays["loss_mask"][0, prompt_position] == 0
    changed = {**arrays, "targets": arrays["targets"].copy()}
    changed["targets"][0, prompt_position] = (changed["targets"][0, prompt_position] + 1) % tiny_model.config.vocab_size
    for a, b in zip(base, _grads(tiny_model, plan, changed)):
        assert np.array_equal(a, b)
    response_position = T - 3  # predicts a response token: inside the loss
    changed["targets"][0, response_position] = (changed["targets"][0, response_position] + 1) % tiny_model.config.vocab_size
    assert not np.array_equal(base[0], _grads(tiny_model, plan, changed)[0])


def test_batched_rows_give_each_sample_its_own_gradient(tiny_model, plan):
    prompts, responses = _rows(tiny_model, [4, 11, 17], [7, 2, 5], seed=3)
    batched = _grads(tiny_model, plan, li.batch_arrays(prompts, responses, 4, boundary=False))
    for row in range(3):
        alone = _grads(tiny_model, plan, li.batch_arrays([prompts[row]], [responses[row]], 1, boundary=False))
        for a, b in zip(batched, alone):
            np.testing.assert_allclose(a[row], b[0], rtol=1e-4, atol=1e-6)
    assert not batched[1][3].any() and not batched[2][3].any()  # the padding row has no gradient


def test_layer_importance_squares_per_sample_and_compiles_once_per_shape(tiny_model):
    prompts = random_prompts(np.random.default_rng(4), [3, 6, 9, 12, 15], tiny_model.config.vocab_size)
    before = li.gate_gradients._cache_size()
    # batch_size 3 is a shape no other test uses: two batches, one bucket, one compile
    result = li.layer_importance(tiny_model, prompts, response_tokens=8, batch_size=3, keep_per_sample=True, progress=False)
    assert li.gate_gradients._cache_size() - before == 1
    L = tiny_model.config.num_hidden_layers
    assert result.prefill.shape == result.decode.shape == (L,)
    assert result.per_sample_prefill.shape == result.per_sample_decode.shape == (5, L)
    np.testing.assert_allclose(result.prefill, (result.per_sample_prefill**2).mean(0))
    np.testing.assert_allclose(result.decode, (result.per_sample_decode**2).mean(0))
    assert (result.decode > 0).all() and 1 <= result.mean_response_tokens <= 8
    assert result.n_samples == 5 and result.mean_prompt_tokens == 9.0

    # Other prompts of the same bucket: no recompile; the same seed: the same samples.
    other = random_prompts(np.random.default_rng(5), [4, 7], tiny_model.config.vocab_size)
    before = li.gate_gradients._cache_size()
    li.layer_importance(tiny_model, other, response_tokens=8, batch_size=3, progress=False)
    assert li.gate_gradients._cache_size() == before
    again = li.layer_importance(tiny_model, prompts, response_tokens=8, batch_size=3, progress=False)
    np.testing.assert_array_equal(again.prefill, result.prefill)
    assert li.LayerImportance.from_dict(result.to_dict()).to_dict() == result.to_dict()


def test_sampled_responses_end_after_the_stop_token(tiny_model):
    prompts = random_prompts(np.random.default_rng(6), [5] * 6, tiny_model.config.vocab_size)
    stops = li._stop_set(tiny_model)
    responses = li._sample_responses(tiny_model, prompts, 40, jax.random.key(0))
    for r in responses:
        assert 1 <= len(r) <= 40 and not any(t in stops for t in r[:-1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(samples=[]), "samples=0"),
        (dict(samples=[[5, 6]], response_tokens=0), "response_tokens=0"),
        (dict(samples=[[5, 6]], batch_size=0), "batch_size=0"),
        (dict(samples=[[]]), "prompt 0 is empty"),
        (dict(samples=[[5, 10_000]]), "outside"),
    ],
)
def test_bad_input_errors(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        li.layer_importance(tiny_model, progress=False, **kwargs)


def test_calibration_prompts_need_samples_and_a_tokenizer(tiny_model):
    with pytest.raises(ValueError, match="samples=0"):
        li.calibration_prompts(tiny_model, 0)
    with pytest.raises(ValueError, match="no tokenizer"):
        li.calibration_prompts(tiny_model, 3)


def _synthetic(prefill, decode):
    return li.LayerImportance(np.asarray(prefill, float), np.asarray(decode, float), 1, 4, False, 3.0, 4.0)


def test_least_important_layers_and_the_finding():
    holds = _synthetic([5, 4, 3, 2, 1, 0.5], [1, 1, 1, 1, 1, 5])
    assert li.least_important_prefill_layers(holds, 2) == [4, 5]
    assert li.least_important_prefill_layers(holds, 0) == []
    finding = li.qualitative_finding(holds)
    assert finding["holds"] and finding["last_third"] == [4, 5] and finding["overlap_with_last_third"] == 2
    assert "holds on this model" in finding["statement"]
    differs = li.qualitative_finding(_synthetic([1, 1, 1, 1, 5, 5], [5, 5, 1, 1, 1, 1]))
    assert not differs["holds"] and "does not hold" in differs["statement"]
    np.testing.assert_array_equal(holds.ranks()[0], [1, 2, 3, 4, 5, 6])
    for k in (-1, 6, 2.5, True):
        with pytest.raises(ValueError, match=f"k={k!r}"):
            li.least_important_prefill_layers(holds, k)


def test_table_plot_and_cli_parser(tmp_path):
    result = _synthetic([5, 4, 3, 2, 1, 0.5], [1, 1, 1, 1, 1, 5])
    table = li.format_table(result).splitlines()
    assert len(table) == 7 and table[1].split()[:3] == ["0", "32.26", "1"]
    li.plot(result, tmp_path / "p" / "importance.png")
    assert (tmp_path / "p" / "importance.png").stat().st_size > 1000
    parser = argparse.ArgumentParser()
    analyze_layers_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze-layers", "--samples", "7", "--response-tokens", "5", "--json", "x.json"])
    assert (args.samples, args.response_tokens, args.json, args.run) == (7, 5, "x.json", analyze_layers_command.run)


def test_cli_rejects_zero_samples_before_loading(monkeypatch):
    monkeypatch.setattr(analyze_layers_command, "load", lambda *a, **k: pytest.fail("loaded a model for an invalid request"))
    parser = argparse.ArgumentParser()
    analyze_layers_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze-layers", "--samples", "0"])
    with pytest.raises(ValueError, match="samples=0"):
        args.run(args)


@pytest.mark.slow
@pytest.mark.real_model
def test_default_model_calibration_mix():
    model = popjax.load()
    prompts, counts = li.calibration_prompts(model, 6)
    assert counts == {"chat instructions": 2, "humaneval prompts": 2, "shakespeare excerpts": 2}
    assert all(1 <= len(p) <= 160 for p in prompts)
    texts = [model.tokenizer.decode(p) for p in prompts]
    assert "<|im_start|>user" in texts[0] and "def " in texts[1] and len(prompts[2]) == 128
