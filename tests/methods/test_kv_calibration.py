"""Calibrated KV projections for Prefill-Only Pruning (popjax.methods.prefill_only) on tiny 4-layer models.

The NumPy references take the residual streams from the transformers model (hidden_states), not
from popjax: with the last layers skipped, every skipped layer's prefill input is the full
model's input of the first skipped layer (the layers before it are causal and unchanged)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import popjax
from popjax import cache, engine
from popjax.methods.prefill_only import calibrate as calibrate_module, kv_store
from popjax.methods.prefill_only.calibrate import calibrate_kv
from popjax.calibration import Corpus
from popjax.requests import pad_batch
from popjax.eval.kv_drift import kv_drift
from popjax.methods import MethodError
from tests.conftest import TINY_BASE, TINY_CONFIGS, random_prompts

SKIP = (2, 3)


def deep_model(directory, name: str, identity: tuple[int, ...] = ()):
    """A random 4-layer tiny checkpoint; layers in ``identity`` get zero o_proj and down_proj
    weights (their residual updates vanish) -> (popjax model, torch model)."""
    model_cls, config_cls, extra = TINY_CONFIGS[name]
    config = getattr(transformers, config_cls)(**{**TINY_BASE, "num_hidden_layers": 4}, **extra)
    torch.manual_seed(1)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            if config.model_type == "qwen2":  # HF initialises biases to zero; make them matter
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
        for i in identity:
            hf.model.layers[i].self_attn.o_proj.weight.zero_()
            hf.model.layers[i].mlp.down_proj.weight.zero_()
    hf.save_pretrained(directory, safe_serialization=True)
    return popjax.load(directory, cache=False), hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(name: str, identity: tuple[int, ...] = ()):
        if (name, identity) not in cache:
            cache[name, identity] = deep_model(tmp_path_factory.mktemp(name), name, identity)
        return cache[name, identity]

    return get


def corpus(n_windows: int, window: int = 32, seed: int = 0) -> Corpus:
    rng = np.random.default_rng(seed)
    return Corpus("random", rng.integers(3, TINY_BASE["vocab_size"], size=(n_windows, window)).astype(np.int32))


# ------------------------------------------------------------------ NumPy reference


def rms(x, w, eps=TINY_BASE["rms_norm_eps"]):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def hidden_states(hf, windows: np.ndarray) -> list[np.ndarray]:
    """Residual stream entering each layer, [n, T, d] float64 (index L: after the last layer)."""
    with torch.no_grad():
        out = hf(torch.tensor(windows, dtype=torch.long), output_hidden_states=True)
    return [h.detach().double().numpy() for h in out.hidden_states]


def kv_rows(hf, layer: int):
    """The layer's k rows then v rows [2·kv_dim, d] and bias [2·kv_dim] (None without)."""
    attn = hf.model.layers[layer].self_attn
    w = np.concatenate([attn.k_proj.weight.detach().double().numpy(), attn.v_proj.weight.detach().double().numpy()])
    b = None if attn.k_proj.bias is None else np.concatenate([attn.k_proj.bias.detach().double().numpy(), attn.v_proj.bias.detach().double().numpy()])
    return w, b


def norm_weight(hf, layer: int) -> np.ndarray:
    return hf.model.layers[layer].input_layernorm.weight.detach().double().numpy()


def rope(x, positions, h, theta=10000.0):
    """x [T, n, h] at positions [T] (HF half-split rotation)."""
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = positions[:, None] * inv[None]
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., h // 2 :], x[..., : h // 2]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def later_attention(hf, layer: int, x_skip, x_full, P: int):
    """Attention outputs (after o_proj) [T − P, d] of tokens P..T−1 of one window, whose queries,
    keys and values come from the full model, attending to prompt keys/values 0..P−1 projected
    from x_skip (prefill-only) and from x_full (the full model) -> (prefill-only, full)."""
    attn, cfg = hf.model.layers[layer].self_attn, hf.config
    n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    h = cfg.hidden_size // n_q
    T = len(x_full)
    g = norm_weight(hf, layer)
    proj = lambda x, name: rms(x, g) @ getattr(attn, name).weight.detach().double().numpy().T
    pos = np.arange(T)
    q = rope(proj(x_full, "q_proj").reshape(T, n_q, h), pos, h)
    outputs = []
    for x_prompt in (x_skip, x_full):
        k = rope(np.concatenate([proj(x_prompt[:P], "k_proj"), proj(x_full[P:], "k_proj")]).reshape(T, n_kv, h), pos, h)
        v = np.concatenate([proj(x_prompt[:P], "v_proj"), proj(x_full[P:], "v_proj")]).reshape(T, n_kv, h)
        out = np.zeros((T - P, n_q, h))
        for t in range(P, T):
            for head in range(n_q):
                kv_head = head // (n_q // n_kv)
                s = k[: t + 1, kv_head] @ q[t, head] / np.sqrt(h)
                a = np.exp(s - s.max())
                out[t - P, head] = (a / a.sum()) @ v[: t + 1, kv_head]
        outputs.append(out.reshape(T - P, -1) @ attn.o_proj.weight.detach().double().numpy().T)
    return outputs


def cos_rows(a, b):
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ------------------------------------------------------------------ fitting


@pytest.mark.parametrize(
    "name, method, ridge",
    [("llama-gqa", "closed_form", 0.0), ("llama-gqa", "closed_form", 0.5), ("qwen2-bias", "closed_form", 0.0),
     ("qwen2-bias", "closed_form", 0.5), ("qwen2-bias", "optax", 0.0)],
)
def test_identity_skipped_layers_keep_the_original_projections(models, name, method, ridge):
    model, hf = models(name, identity=SKIP)
    options = dict(steps=3) if method == "optax" else {}
    cal = calibrate_kv(model, skip=list(SKIP), prompts=corpus(4), ridge=ridge, method=method, cache=False, **options)
    assert cal.skip == SKIP
    for layer in SKIP:
        w, b = kv_rows(hf, layer)
        np.testing.assert_allclose(cal.weights[layer], w, rtol=0, atol=1e-6)
        if b is not None:
            np.testing.assert_allclose(cal.biases[layer], b, rtol=0, atol=1e-6)
        if method == "closed_form":
            assert cal.fit["layers"][str(layer)]["k_err_before"] < 1e-10
    if method == "optax":
        assert max(cal.fit["loss"]) < 1e-10


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
@pytest.mark.parametrize("ridge", [0.0, 0.3])
def test_closed_form_equals_numpy_least_squares(models, name, ridge):
    model, hf = models(name)
    data = corpus(8)  # 256 tokens > d + 1 = 65 unknowns
    cal = calibrate_kv(model, skip=list(SKIP), prompts=data, ridge=ridge, cache=False)
    hs = hidden_states(hf, data.windows)
    d = TINY_BASE["hidden_size"]
    for layer in SKIP:
        w, b = kv_rows(hf, layer)
        g = norm_weight(hf, layer)
        Z = rms(hs[SKIP[0]], g).reshape(-1, d)  # prefill-only input: layer 2's input, passed through
        X = rms(hs[layer], g).reshape(-1, d)
        Y = X @ w.T + (0 if b is None else b)
        W = w if b is None else np.concatenate([w, b[:, None]], axis=1)
        if b is not None:
            Z = np.concatenate([Z, np.ones((len(Z), 1))], axis=1)
        # ridge toward W as an augmented least-squares problem: rows √(λs)·I with targets √(λs)·Wᵀ
        root = np.sqrt(ridge * np.trace(Z[:, :d].T @ Z[:, :d]) / d)
        A = np.concatenate([Z, root * np.eye(Z.shape[1])])
        B = np.concatenate([Y, root * W.T])
        want = np.linalg.lstsq(A, B, rcond=None)[0].T
        np.testing.assert_allclose(cal.weights[layer], want[:, :d], rtol=0, atol=2e-4)
        if b is not None:
            np.testing.assert_allclose(cal.biases[layer], want[:, d], rtol=0, atol=2e-4)
        fit = cal.fit["layers"][str(layer)]
        err = lambda M: np.sum((Z @ M.T - Y) ** 2) / np.sum(Y**2)
        np.testing.assert_allclose(
            fit["k_err_after"] * np.sum(Y[:, : w.shape[0] // 2] ** 2) + fit["v_err_after"] * np.sum(Y[:, w.shape[0] // 2 :] ** 2),
            err(want) * np.sum(Y**2), rtol=1e-3, atol=1e-8,
        )
        assert fit["k_err_after"] <= fit["k_err_before"] + 1e-9 and fit["v_err_after"] <= fit["v_err_before"] + 1e-9
    assert cal.fit["layers"]["3"]["v_err_after"] < 0.9 * cal.fit["layers"]["3"]["v_err_before"]


def test_optax_loss_decreases_monotonically_on_a_fixed_batch(models):
    model, _ = models("llama-gqa")
    cal = calibrate_kv(model, skip=list(SKIP), prompts=corpus(4), method="optax", steps=12,
                           learning_rate=2e-3, weight_decay=0.0, batch_size=4, cache=False)
    loss = np.array(cal.fit["loss"])
    assert len(loss) == 12 and loss[0] > 1e-4
    assert np.all(np.diff(loss) < 0), loss
    assert cal.fit["loss_after"] < cal.fit["loss_before"] == pytest.approx(loss[0], rel=1e-5)


# ------------------------------------------------------------------ use in prefill


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_calibrated_prefill_caches_equal_a_numpy_projection(models, name):
    model, hf = models(name)
    cal = calibrate_kv(model, skip=list(SKIP), prompts=corpus(4), ridge=0.1, cache=False)
    prompts = random_prompts(np.random.default_rng(5), [7, 12], model.config.vocab_size)
    tokens, mask = pad_batch(prompts, 0)
    method = popjax.PrefillOnly(skip=list(SKIP), kv="calibrated", kv_calibration=cal)
    _, caches, _, _ = engine.prefill(model.graphdef, model.params, jnp.asarray(tokens), jnp.asarray(mask), method.bind(model.config),
                                     data=method.data(model))
    cfg, T = model.config, tokens.shape[1]
    for row, ids in enumerate(prompts):
        n = len(ids)
        x = hidden_states(hf, np.array([ids[:-1]]))[SKIP[0]][0]  # prefilled tokens 1..N−1
        for layer in SKIP:
            kv = rms(x, norm_weight(hf, layer)) @ np.asarray(cal.weights[layer], np.float64).T
            if cal.biases:
                kv = kv + cal.biases[layer]
            k = rope(kv[:, : cfg.kv_dim].reshape(n - 1, -1, cfg.head_dim), np.arange(n - 1), cfg.head_dim)
            v = kv[:, cfg.kv_dim :].reshape(n - 1, -1, cfg.head_dim)
            np.testing.assert_allclose(np.asarray(caches[layer].k[row, T - n : T - 1]), k, rtol=0, atol=1e-5)
            np.testing.assert_allclose(np.asarray(caches[layer].v[row, T - n : T - 1]), v, rtol=0, atol=1e-5)


@pytest.mark.slow  # calibrates, then compiles prefill twice per method and generates twice (~5 s)
def test_decode_and_other_methods_ignore_the_calibrated_weights(models):
    """The calibrated weights are read only by kv="calibrated" prefill: given to dense or to the
    independent projection (whose boundary step runs the decode path over the prefilled caches)
    they change nothing; through generate the calibrated method runs from its own data."""
    model, _ = models("llama-gqa")
    calibrated = popjax.PrefillOnly(skip=list(SKIP), kv="calibrated",
                                    kv_calibration=calibrate_kv(model, skip=list(SKIP), prompts=corpus(4), cache=False))
    data = calibrated.data(model)
    prompts = random_prompts(np.random.default_rng(6), [9, 14], model.config.vocab_size)
    tokens, mask = (jnp.asarray(a) for a in pad_batch(prompts, 0))
    for method in (popjax.Dense(), popjax.PrefillOnly(skip=list(SKIP))):
        plan = method.bind(model.config)
        got = engine.prefill(model.graphdef, model.params, tokens, mask, plan, data=data)
        want = engine.prefill(model.graphdef, model.params, tokens, mask, plan)
        for a, b in zip(jax.tree_util.tree_leaves(got[:2]), jax.tree_util.tree_leaves(want[:2])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ours = popjax.generate_ids(model, prompts, 4, method=calibrated, stop_ids=[])[0]
    assert [len(row) for row in ours] == [4, 4]
    independent = popjax.generate_ids(model, prompts, 4, method=popjax.PrefillOnly(skip=list(SKIP)), stop_ids=[])[0]
    assert [len(row) for row in independent] == [4, 4]


# ------------------------------------------------------------------ files


def test_cached_and_saved_projections_reload_bit_exact(models, tmp_path, monkeypatch):
    model, _ = models("qwen2-bias")
    data = corpus(4)
    first = calibrate_kv(model, skip=list(SKIP), prompts=data, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(calibrate_module, "fit_closed_form", lambda *a, **k: pytest.fail("refitted instead of loading"))
    again = calibrate_kv(model, skip=list(SKIP), prompts=data, cache_dir=tmp_path / "cache")
    saved = kv_store.save_kv_calibration(first, tmp_path / "saved")
    loaded = kv_store.load_kv_calibration(saved, skip=list(SKIP), model=model)
    for cal in (again, loaded):
        assert cal.skip == first.skip and cal.key == first.key and cal.fit == first.fit
        for layer in SKIP:
            for a, b in ((cal.weights[layer], first.weights[layer]), (cal.biases[layer], first.biases[layer])):
                assert a.dtype == b.dtype == np.float32
                np.testing.assert_array_equal(a, b)
    # a popjax.cache entry (`popjax cache list` shows it); another skip set is another entry
    (entry,) = cache.list_entries(tmp_path / "cache")
    assert entry.kind == kv_store.KIND and entry.path == kv_store.cache_path(first.key, tmp_path / "cache")
    assert entry.key_fields == first.key and (entry.path / kv_store.RECORD).is_file()
    assert kv_store.cache_path({**first.key, "skip": [3]}, tmp_path) != kv_store.cache_path(first.key, tmp_path)


@pytest.mark.parametrize("damage", ["record", "arrays"])
def test_a_corrupt_cache_entry_is_refitted(models, tmp_path, caplog, damage):
    model, _ = models("llama-gqa")
    first = calibrate_kv(model, skip=list(SKIP), prompts=corpus(4), cache_dir=tmp_path)
    path = kv_store.cache_path(first.key, tmp_path)
    if damage == "record":
        record = path / kv_store.RECORD
        record.write_text(record.read_text().replace('"checksum": "', '"checksum": "0'))
    else:  # flip a byte of the largest orbax file
        data = max((p for p in (path / "arrays").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        again = calibrate_kv(model, skip=list(SKIP), prompts=corpus(4), cache_dir=tmp_path)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "fails its checksum" in warnings[0] and str(path) in warnings[0], warnings
    assert "\n" not in warnings[0]  # a one-line notice
    np.testing.assert_array_equal(again.weights[2], first.weights[2])
    assert cache.check_entry(path) is None and cache.list_entries(tmp_path)[0].path == path


# ------------------------------------------------------------------ drift


def test_drift_matches_numpy_and_is_one_for_identity_layers(models):
    model, hf = models("llama-gqa")
    data = corpus(2, window=16, seed=3)
    report = kv_drift(model, list(SKIP), prompts=data)
    hs = hidden_states(hf, data.windows)
    cfg, P = model.config, 8
    for i, layer in enumerate(SKIP):
        w, _ = kv_rows(hf, layer)
        g = norm_weight(hf, layer)
        x_skip, x_full = hs[SKIP[0]][:, :P], hs[layer][:, :P]
        want = {"hidden": [], "k": [], "v": []}
        for row in range(2):
            want["hidden"].append(cos_rows(x_skip[row], x_full[row]))
            ks, kf = rms(x_skip[row], g) @ w.T, rms(x_full[row], g) @ w.T
            want["k"].append(cos_rows(ks[:, : cfg.kv_dim], kf[:, : cfg.kv_dim]))
            want["v"].append(cos_rows(ks[:, cfg.kv_dim :], kf[:, cfg.kv_dim :]))
        want["attn"] = [cos_rows(*later_attention(hf, layer, hs[SKIP[0]][row], hs[layer][row], P)) for row in range(2)]
        for name, values in want.items():
            np.testing.assert_allclose(report[name][i], np.mean(values), rtol=0, atol=1e-5)
    assert report["attn"][0] == pytest.approx(1.0) and report["attn"][1] < 0.999  # the first skipped layer does not drift
    identity, _ = models("llama-gqa", identity=SKIP)
    cal = calibrate_kv(identity, skip=list(SKIP), prompts=corpus(4), cache=False)
    same = kv_drift(identity, list(SKIP), prompts=data, calibration=cal)
    for name in ("hidden", "k", "v", "k_cal", "v_cal"):  # (attention outputs are 0 there: o_proj is zero)
        np.testing.assert_allclose(same[name], 1.0, atol=1e-5)


def test_calibration_improves_drift_on_its_own_data(models):
    model, _ = models("llama-gqa")
    data = corpus(8)
    cal = calibrate_kv(model, skip=list(SKIP), prompts=data, ridge=0.0, cache=False)
    report = kv_drift(model, list(SKIP), prompts=data, calibration=cal)
    for name in ("k", "v", "attn"):  # layer 3 drifts (layer 2, the first skipped, sees the full model's input)
        assert report[name + "_cal"][1] > report[name][1] + 0.01, report


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(ridge=0.0, prompts=corpus(1)), r"ridge=0 with 32 calibration tokens: fewer than the 64 unknowns per output \(hidden size 64\)"),
        (dict(ridge=-0.5), r"ridge=-0.5 is negative; use ridge ≥ 0"),
        (dict(ridge=float("nan")), r"ridge=nan is not a finite number"),
        (dict(method="sgd"), r"method='sgd' is not one of \('closed_form', 'optax'\)"),
        (dict(method="optax", steps=0), r"steps=0 is invalid"),
        (dict(method="optax", prefix=32), r"prefix=32 is invalid for windows of 32 tokens"),
        (dict(steps=5), r"\['steps'\] only apply to method='optax'"),
        (dict(method="optax", lr=0.1), r"unknown optax settings \['lr'\]; valid: steps, learning_rate"),
        (dict(skip=[]), r"skip=\(\) skips no layer"),
        (dict(skip=[4]), r"skip holds layers \[4\] outside \[0, 4\)"),
    ],
)
def test_bad_calibration_input(models, options, message):
    model, _ = models("llama-gqa")
    options = {"skip": list(SKIP), "prompts": corpus(2), "cache": False, **options}
    with pytest.raises(MethodError, match=message):
        calibrate_kv(model, **options)


def test_bias_model_counts_the_bias_column(models):
    model, _ = models("qwen2-bias")
    with pytest.raises(MethodError, match=r"fewer than the 65 unknowns per output \(hidden size 64 \+ 1 bias column\)"):
        calibrate_kv(model, skip=list(SKIP), prompts=corpus(2), ridge=0.0, cache=False)


def test_a_calibration_for_another_skip_set_or_model_is_refused(models, tmp_path):
    model, _ = models("llama-gqa")
    cal = calibrate_kv(model, skip=list(SKIP), prompts=corpus(2), cache=False)
    path = kv_store.save_kv_calibration(cal, tmp_path / "cal")
    with pytest.raises(MethodError, match=r"fitted for skipped layers \[2, 3\], not skip=\[3\] \(layers \[3\]\)"):
        kv_store.load_kv_calibration(path, skip=[3])
    with pytest.raises(MethodError, match=r"fitted for skipped layers \[2, 3\], not skip=1 \(layers \[3\]\)"):
        kv_store.load_kv_calibration(path, skip=1)
    other, _ = models("llama-gqa", identity=SKIP)
    with pytest.raises(MethodError, match=r"was fitted for model .*, not this one"):
        kv_store.load_kv_calibration(path, model=other)
    with pytest.raises(MethodError, match=r"the calibration was fitted for model .*, not this one"):
        popjax.PrefillOnly(skip=list(SKIP), kv="calibrated", kv_calibration=cal).prepare(other)
    with pytest.raises(FileExistsError, match="already exists"):
        kv_store.save_kv_calibration(cal, path)
    prompt = [[5, 6, 7, 8]]
    with pytest.raises(MethodError, match=r"fitted for skipped layers \[2, 3\], but this method skips \[3\]"):
        popjax.generate_ids(model, prompt, 2, method=popjax.PrefillOnly(skip=[3], kv="calibrated", kv_calibration=cal))
    unprepared = popjax.PrefillOnly(skip=list(SKIP), kv="calibrated")
    with pytest.raises(MethodError, match=r"PrefillOnly\(kv='calibrated'\) is not prepared"):
        unprepared.data(model)
    tokens, mask = (jnp.asarray(a) for a in pad_batch(prompt, 0))
    with pytest.raises(ValueError, match=r"the prefill-only plan reads its method's calibrated data, and none was given"):
        engine.prefill(model.graphdef, model.params, tokens, mask, unprepared.bind(model.config))
    with pytest.raises(MethodError, match=r"kv_calibration is given but kv='none'"):
        popjax.PrefillOnly(skip=list(SKIP), kv="none", kv_calibration=cal)
    with pytest.raises(MethodError, match=r"kv='fitted' is not one of \('independent', 'calibrated', 'none'\)"):
        popjax.PrefillOnly(kv="fitted")
