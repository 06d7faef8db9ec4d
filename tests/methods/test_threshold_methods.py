"""TEAL and CATS against plain NumPy references of docs/methods.md §5 (given thresholds), their budgets,
calibration on real collected statistics, and errors."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import popjax
from popjax.calibration import Statistic, collect
from popjax.methods import CATS, CATSPlan, DensePlan, MethodError, TEAL, TEALPlan, Thresholds, kept_channels
from popjax.methods.teal import thresholds_data
from popjax.models import ModelConfig
from tests.conftest import random_prompts
from tests.reference.corpus import tiny_corpus
from tests.reference.ffn import as_jax, random_layer, silu

ATOL = 1e-5


# ------------------------------------------------------------------ the NumPy references


def ref_masks(V, valid, t, how):
    """V [B, n] magnitudes' source, valid [B] -> (keep [B, n] bool, actual density)."""
    B, n = V.shape
    rows = [b for b in range(B) if valid[b]]
    if how == "per_token":
        keep = np.abs(V) > t
        density = sum(keep[b].sum() for b in rows) / (len(rows) * n) if rows else 0.0
        return keep, density
    agg = np.zeros(n)
    for j in range(n):
        column = [abs(V[b, j]) for b in rows]
        if column:
            agg[j] = max(column) if how == "max" else sum(column) / len(column)
    shared = agg > t
    return np.tile(shared, (B, 1)), shared.mean()


def ref_teal(W, x, valid, tx, th, how):
    """One decode step: zero x_i with |·| ≤ tx, then H_j with |·| ≤ th -> (y [B, d], dens_x, dens_h)."""
    x = x[:, 0]
    keep_x, dens_x = ref_masks(x, valid, tx, how)
    xs = np.where(keep_x, x, 0.0)
    H = silu(xs @ W["gate"]) * (xs @ W["up"])
    keep_h, dens_h = ref_masks(H, valid, th, how)
    return np.where(keep_h, H, 0.0) @ W["down"], dens_x, dens_h


def ref_cats(W, x, valid, t, how):
    x = x[:, 0]
    gate = silu(x @ W["gate"])
    keep, dens = ref_masks(gate, valid, t, how)
    return (np.where(keep, gate, 0.0) * (x @ W["up"])) @ W["down"], dens


# ------------------------------------------------------------------ plans vs references


def _step_inputs(rng, B, d):
    x = rng.normal(0, 1.0, (B, 1, d))
    valid = np.ones(B, bool)
    if B > 2:
        valid[1] = False
        x[1] *= 100.0  # an invalid row must not move the shared mask
    return x, valid


@pytest.mark.parametrize("how", ["per_token", "max", "mean"])
@pytest.mark.parametrize("B", [1, 4])
def test_teal_matches_reference(how, B):
    rng = np.random.default_rng(B)
    d, f, L = 16, 48, 3
    layers = [random_layer(rng, d, f) for _ in range(L)]
    tx = tuple(float(v) for v in rng.uniform(0.3, 1.0, L))
    th = tuple(float(v) for v in rng.uniform(0.02, 0.3, L))
    plan = TEALPlan(f=f, n_keep=f // 2, sparsity=0.5, aggregate=how)
    data = thresholds_data({"x": tx, "h": th})  # the method's data, as generate passes it (w.data)
    decode = jax.jit(plan.decode)
    seen = []
    for layer, W in enumerate(layers):  # the layer index picks the layer's thresholds
        w = as_jax(W, layer, data=data)
        for step in range(3):
            x, valid = _step_inputs(rng, B, d)
            y, state, aux = decode(w, None, jnp.asarray(x, jnp.float32), step, jnp.asarray(valid[:, None]))
            y_ref, dens_x, dens_h = ref_teal(W, x, valid, tx[layer], th[layer], how)
            assert state is None
            np.testing.assert_allclose(np.asarray(y)[valid, 0], y_ref[valid], atol=ATOL)
            assert float(aux["density_x"]) == pytest.approx(dens_x, abs=1e-6)
            assert float(aux["density_h"]) == pytest.approx(dens_h, abs=1e-6)
            assert float(aux["density"]) == pytest.approx((2 * dens_x + dens_h) / 3, abs=1e-6)
            seen += [dens_x, dens_h]
    assert min(seen) < 1.0 and max(seen) > 0.0  # the thresholds do bite


@pytest.mark.parametrize("how", ["per_token", "max", "mean"])
@pytest.mark.parametrize("B", [1, 4])
def test_cats_matches_reference(how, B):
    rng = np.random.default_rng(10 + B)
    d, f, L = 16, 48, 2
    layers = [random_layer(rng, d, f) for _ in range(L)]
    t = tuple(float(v) for v in rng.uniform(0.1, 0.4, L))
    plan = CATSPlan(f=f, n_keep=30, sparsity=0.5, aggregate=how)
    data = thresholds_data({"gate": t})
    decode = jax.jit(plan.decode)
    seen = []
    for layer, W in enumerate(layers):
        w = as_jax(W, layer, data=data)
        for step in range(3):
            x, valid = _step_inputs(rng, B, d)
            y, _, aux = decode(w, None, jnp.asarray(x, jnp.float32), step, jnp.asarray(valid[:, None]))
            y_ref, dens = ref_cats(W, x, valid, t[layer], how)
            np.testing.assert_allclose(np.asarray(y)[valid, 0], y_ref[valid], atol=ATOL)
            assert float(aux["density_channels"]) == pytest.approx(dens, abs=1e-6)
            assert float(aux["density"]) == pytest.approx((1 + 2 * dens) / 3, abs=1e-6)
            seen.append(dens)
    assert min(seen) < 1.0 and max(seen) > 0.0


def test_batched_rule_at_batch_one_is_per_token():
    rng = np.random.default_rng(2)
    W = random_layer(rng, 16, 32)
    w = as_jax(W, 0, data=thresholds_data({"x": (0.6,), "h": (0.1,)}))
    x = jnp.asarray(rng.normal(0, 1, (1, 1, 16)), jnp.float32)
    outs = [
        TEALPlan(f=32, n_keep=16, sparsity=0.5, aggregate=how).decode(w, None, x, 0, jnp.ones((1, 1), bool))[0]
        for how in ("per_token", "max", "mean")
    ]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_prefill_is_dense():
    rng = np.random.default_rng(3)
    W = random_layer(rng, 16, 32)
    w = as_jax(W, 0)
    X = jnp.asarray(rng.normal(0, 1, (2, 5, 16)), jnp.float32)
    valid = jnp.ones((2, 5), bool)
    dense = DensePlan(f=32, n_keep=32).prefill(w, X, valid)[0]
    data = thresholds_data({"x": (9.0,), "h": (9.0,), "gate": (9.0,)})
    teal = TEALPlan(f=32, n_keep=16, sparsity=0.5).prefill(w.replace(data=data), X, valid)
    cats = CATSPlan(f=32, n_keep=16, sparsity=0.5).prefill(w.replace(data=data), X, valid)
    np.testing.assert_array_equal(teal[0], dense)
    np.testing.assert_array_equal(cats[0], dense)


# ------------------------------------------------------------------ budgets

TINY = ModelConfig.from_hf_dict(
    dict(model_type="llama", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
         num_hidden_layers=2, vocab_size=160, max_position_embeddings=256)
)


def _calibrated(method, cfg=TINY, value=0.5):
    """A method with placeholder thresholds for its own targets (budget tests need no data)."""
    targets = method.targets(cfg)
    thresholds = Thresholds(
        tuple((t, s) for t, (_, s) in targets.items()), tuple((t, (value,) * cfg.num_hidden_layers) for t in targets)
    )
    return dataclasses.replace(method, thresholds=thresholds)


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.3])
def test_ratio_maps_to_equal_expected_weights_read(ratio):
    d, f, n_keep = TINY.hidden_size, TINY.intermediate_size, kept_channels(TINY, ratio)
    teal = _calibrated(TEAL(ratio)).bind(TINY)
    cats = _calibrated(CATS(ratio)).bind(TINY)
    assert teal.sparsity == pytest.approx(1 - n_keep / f)
    assert cats.sparsity == pytest.approx(1.5 * (1 - n_keep / f))
    for plan in (teal, cats):
        assert plan.ffn_weights_read(d) == 3 * d * n_keep
        assert plan.ffn_flops_per_token(d) == 6 * d * n_keep
        assert plan.n_keep == n_keep


def test_ffn_sparsity_is_the_papers_sparsity():
    d, f = TINY.hidden_size, TINY.intermediate_size
    teal = _calibrated(TEAL(ffn_sparsity=0.5)).bind(TINY)
    cats = _calibrated(CATS(ffn_sparsity=0.5)).bind(TINY)
    assert teal.sparsity == cats.sparsity == 0.5
    assert teal.ffn_weights_read(d) == round(1.5 * d * f)
    assert cats.ffn_weights_read(d) == 2 * d * f  # all of W_g, half of W_u and W_d
    assert isinstance(TEAL(ratio=0.0).bind(TINY), DensePlan)  # no calibration needed
    assert isinstance(CATS(ffn_sparsity=0.0).bind(TINY), DensePlan)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: TEAL(aggregate="median"), r"TEAL: aggregate='median' is not one of \('max', 'mean', 'per_token'\)"),
        (lambda: CATS(aggregate="shared"), r"CATS: aggregate='shared' is not one of"),
        (lambda: TEAL(ratio=1.2), r"ratio=1.2 is outside \[0, 1\)"),
        (lambda: CATS(ratio=-0.5), r"ratio=-0.5 is outside \[0, 1\)"),
        (lambda: TEAL(ffn_sparsity=1.0), r"TEAL: ffn_sparsity=1.0 is outside \[0, 1\)"),
        (lambda: CATS(ratio=0.2, ffn_sparsity=0.5), r"CATS: give ratio=0.2 or ffn_sparsity=0.5, not both"),
        (lambda: TEAL(thresholds=(0.1, 0.2)), r"TEAL: thresholds=\(0.1, 0.2\) is not a Thresholds"),
        (lambda: TEAL(0.2).bind(TINY), r"TEAL has no thresholds: use TEAL\(...\).calibrate\(model\)"),
        (lambda: CATS(0.2).data(SimpleNamespace(config=TINY)), r"CATS has no thresholds: use CATS\(...\).calibrate\(model\)"),
        (lambda: CATS(0.4).targets(TINY), r"CATS: ratio=0.4 keeps n_keep=32 of f=96 channels; .* n_keep > f/3"),
        (
            lambda: dataclasses.replace(_calibrated(TEAL(0.2)), ratio=0.3).bind(TINY),
            r"TEAL: thresholds were calibrated for sparsity .*, this budget needs",
        ),
        (
            lambda: _calibrated(CATS(0.2), cfg=dataclasses.replace(TINY, num_hidden_layers=3)).bind(TINY),
            r"CATS: 3 thresholds for 'gate', the model has 2 layers",
        ),
    ],
)
def test_bad_arguments(build, message):
    with pytest.raises(MethodError, match=message):
        build()


# ------------------------------------------------------------------ calibration on a model


@dataclasses.dataclass(frozen=True)
class Survivors(Statistic):
    """Exact counts of entries above given per-layer thresholds (x, H, silu(W_g x))."""

    name: ClassVar[str] = "test_survivors"
    tx: tuple = ()
    th: tuple = ()
    tg: tuple = ()

    def collect(self, w, x, valid, h):
        gate = jax.nn.silu(jnp.einsum("btd,nd->btn", x, w.gate_up[0]))
        out = {"tokens": jnp.sum(valid)}
        for name, v, t in (("x", x, self.tx), ("h", h, self.th), ("gate", gate, self.tg)):
            above = jnp.abs(v) > jnp.asarray(t, jnp.float32)[w.layer]
            out[name] = jnp.sum(above & valid[..., None])
        return out


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.8])
def test_calibration_hits_the_target_sparsity_on_its_data(tiny_model, tmp_path, sparsity):
    corpus = tiny_corpus()
    teal = TEAL(ffn_sparsity=sparsity).calibrate(tiny_model, corpus, cache_dir=tmp_path)
    cats = CATS(ffn_sparsity=sparsity).calibrate(tiny_model, corpus, cache_dir=tmp_path)
    t = teal.thresholds
    counts = collect(tiny_model, Survivors(t.get("x"), t.get("h"), cats.thresholds.get("gate")), corpus)
    d, f = tiny_model.config.hidden_size, tiny_model.config.intermediate_size
    tokens = counts["tokens"]
    for name, width in (("x", d), ("h", f), ("gate", f)):
        achieved = 1.0 - counts[name] / (tokens * width)  # per layer
        assert np.all(np.abs(achieved - sparsity) <= 0.01), (name, achieved)
    assert "tiny-text" in t.source


def test_prepare_calibrates_once_and_generation_reports_densities(tiny_model, monkeypatch):
    corpus = tiny_corpus()
    monkeypatch.setattr("popjax.methods.base.default_corpus", lambda model: corpus)
    teal = TEAL(ratio=0.2).prepare(tiny_model)
    assert teal.prepare(tiny_model) is teal and teal.thresholds is not None
    assert TEAL(ratio=0.0).prepare(tiny_model).thresholds is None  # dense: nothing to calibrate
    L = tiny_model.config.num_hidden_layers
    prompts = random_prompts(np.random.default_rng(0), (5, 9, 7), tiny_model.config.vocab_size)
    cats = CATS(ratio=0.2).prepare(tiny_model)
    for method, batch in ((teal, prompts[:1]), (teal, prompts), (cats, prompts)):
        ids, trace = popjax.generate_ids(tiny_model, batch, 8, method=method, ignore_eos=True, return_trace=True)
        density = trace["decode"]["density"]
        assert [len(r) for r in ids] == [8] * len(batch) and density.shape == (7, L)
        assert np.all((density > 0) & (density < 1))
    dense, _ = popjax.generate_ids(tiny_model, prompts, 8, ignore_eos=True)
    assert popjax.generate_ids(tiny_model, prompts, 8, method=TEAL(ratio=0.0), ignore_eos=True)[0] == dense


def test_bad_calibration_corpus(tiny_model, tmp_path):
    from popjax.calibration import CalibrationError

    with pytest.raises(MethodError, match=r"corpus=42 is neither a popjax.calibration.Corpus nor a text file path"):
        TEAL(0.2).calibrate(tiny_model, corpus=42)
    path = tmp_path / "text.txt"
    path.write_text("some text")
    with pytest.raises(CalibrationError, match="the model has no tokenizer"):
        CATS(0.2).calibrate(tiny_model, corpus=str(path))
