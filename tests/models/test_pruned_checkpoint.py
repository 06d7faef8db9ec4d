"""Wanda-sp and FLAP on a tiny model: their calibration against NumPy references (layers pruned in
order; FLAP's adaptive widths and bias), and as pruned checkpoints (popjax.pruned): smaller FFNs,
per-layer widths and a down bias, saved and reloaded like any converted model, with the logits
of the online method."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import popjax
from popjax.calibration import CalibrationError, Corpus, Statistic, collect
from popjax.methods import FLAP, GRIFFIN, POP, Dense, MethodError, ProbePruning, Static, WandaSP, kept_channels
from popjax.models import ConfigError, ModelConfig
from popjax.pruned import prune_model, save_pruned
from tests.reference.ffn import ref_rank
from tests.reference.methods import ref_flap

ATOL = 1e-5
FLAP_RATIO = 0.2  # at this ratio the skewed tiny model's two layers get different widths (79, 49)


# ------------------------------------------------------------------ a tiny model and its activations


def make_skewed_checkpoint(source: Path, target: Path, seed: int = 0) -> Path:
    """A copy of a tiny checkpoint whose layer-0 down columns have heavy-tailed norms, so FLAP's
    standardised scores differ in shape across layers (and its per-layer widths differ)."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    scale = np.exp(np.random.default_rng(seed).normal(0, 1.5, tensors[name].shape[1])).astype(np.float32)
    tensors[name] = tensors[name] * scale
    save_file(tensors, target / "model.safetensors")
    return target


def random_corpus(vocab: int, n_windows: int = 8, window: int = 32, seed: int = 0) -> Corpus:
    ids = np.random.default_rng(seed).integers(3, vocab, size=n_windows * window)
    return Corpus.from_token_ids(f"random-{seed}", ids, window=window)


@dataclasses.dataclass(frozen=True)
class RawActivations(Statistic):
    """Test statistic: H itself (one batch: the "sum" is the value), with the MLP output pruned to
    a per-layer 0/1 channel ``table`` (dense when None)."""

    name: ClassVar[str] = "test_raw_activations"
    table: tuple | None = None

    def collect(self, w, x, valid, h):
        return {"h": jnp.where(valid[..., None], h, 0.0)}

    def output(self, w, x, valid, h):
        if self.table is not None:
            h = h * jnp.asarray(self.table, h.dtype)[w.layer]
        return jnp.einsum("btf,df->btd", h, w.down)


def capture_activations(model, corpus, kept=None) -> np.ndarray:
    """H at every layer for every corpus token -> [L, N, f] float64, with the layers' MLPs pruned
    to ``kept`` (per-layer channel ids) or dense when None."""
    f = model.config.intermediate_size
    table = None if kept is None else tuple(tuple(float(j in set(k)) for j in range(f)) for k in kept)
    out = collect(model, RawActivations(table), corpus, batch_size=len(corpus.windows))
    return out["h"].reshape(model.config.num_hidden_layers, -1, f)


def _mlp(model, layer: int) -> dict:
    return nnx.to_pure_dict(model.params)["layers"][layer]["mlp"]


def layer_downs(model) -> list[np.ndarray]:
    return [np.asarray(_mlp(model, l)["down"], np.float64) for l in range(model.config.num_hidden_layers)]


@pytest.fixture(scope="module")
def model(tiny_checkpoints, tmp_path_factory):
    source, _ = tiny_checkpoints("llama-gqa")
    return popjax.load(make_skewed_checkpoint(source, tmp_path_factory.mktemp("skewed") / "ckpt"), cache=False)


@pytest.fixture(scope="module")
def calibrated(model):
    """name -> the method calibrated once on a random-token corpus (cache in a temp dir)."""
    corpus = random_corpus(model.config.vocab_size)
    return {m.name: m.calibrate(model, corpus) for m in (WandaSP(0.3), FLAP(FLAP_RATIO))}


def _ids(model, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(3, model.config.vocab_size, size=(3, 13))


# ------------------------------------------------------------------ calibration against NumPy


def test_wanda_sp_prunes_layers_in_order(model):
    """Layer l's channels are Wanda-sp's top n_keep on activations that passed through the
    pruned layers < l (reference: H captured under the final selection, scored in NumPy)."""
    corpus = random_corpus(model.config.vocab_size, seed=1)
    method = WandaSP(0.45).calibrate(model, corpus)
    n_keep = kept_channels(model.config, 0.45)
    kept = method.selection.kept
    assert method.selection.widths == (n_keep,) * model.config.num_hidden_layers
    refs = {}
    for name, H in (("in_order", capture_activations(model, corpus, kept)), ("dense", capture_activations(model, corpus))):
        refs[name] = []
        for l, down in enumerate(layer_downs(model)):
            scores = [
                sum(abs(down[i, j]) for i in range(down.shape[0])) / down.shape[0] * math.sqrt(float(np.mean(H[l][:, j] ** 2)))
                for j in range(down.shape[1])
            ]
            refs[name].append(sorted(ref_rank(scores)[:n_keep]))
    assert [list(k) for k in kept] == refs["in_order"]
    assert refs["dense"][0] == refs["in_order"][0] and refs["dense"][1] != refs["in_order"][1]  # layer 1 saw pruned inputs


def test_flap_on_model_matches_reference(model, calibrated):
    """FLAP's kept sets, per-layer widths and bias from the dense model's activations."""
    sel = calibrated["flap"].selection
    n_keep, L = kept_channels(model.config, FLAP_RATIO), model.config.num_hidden_layers
    H = capture_activations(model, random_corpus(model.config.vocab_size))
    ref_kept, ref_bias = ref_flap(list(H), layer_downs(model), n_keep, floor=5)  # ⌈0.05·96⌉
    assert [list(k) for k in sel.kept] == ref_kept
    assert sum(sel.widths) == L * n_keep and len(set(sel.widths)) > 1
    np.testing.assert_allclose(np.asarray(sel.bias), ref_bias, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ pruned checkpoints


@pytest.mark.parametrize("name", ["wanda-sp", "flap"])
def test_pruned_checkpoint_reloads_with_the_online_logits(model, calibrated, name, tmp_path):
    method = calibrated[name]
    cfg, n_keep = model.config, kept_channels(model.config, method.ratio)
    pruned = prune_model(model, method)
    widths = method.selection.widths
    if name == "wanda-sp":
        assert pruned.config.intermediate_size == n_keep and pruned.config.intermediate_sizes is None
        assert not pruned.config.down_proj_bias
    else:
        assert pruned.config.intermediate_sizes == widths and len(set(widths)) > 1  # adaptive widths
        assert pruned.config.intermediate_size == n_keep and sum(widths) == cfg.num_hidden_layers * n_keep
        assert pruned.config.down_proj_bias

    directory = save_pruned(pruned, tmp_path / f"{name}-pruned")
    saved = json.loads((directory / "config.json").read_text())
    assert saved.get("intermediate_sizes") == (None if name == "wanda-sp" else list(widths))
    reloaded = popjax.load(directory)
    assert reloaded.config == pruned.config
    for i, w in enumerate(widths):
        layer = _mlp(reloaded, i)
        assert layer["gate_up"].shape == (2, w, cfg.hidden_size) and layer["down"].shape == (cfg.hidden_size, w)

    ids = _ids(model)
    online = np.asarray(popjax.forward(model, ids, method=method))
    offline = np.asarray(popjax.forward(reloaded, ids))
    np.testing.assert_allclose(offline, online, atol=ATOL)
    assert np.abs(online - np.asarray(popjax.forward(model, ids))).max() > 1e-2  # pruning changed something
    if name == "wanda-sp":
        return  # its decode path is FLAP's without the bias (SelectionPlan), checked below once
    # decode path: greedy continuations of the online method and of the checkpoint agree
    prompts = [row[: n].tolist() for row, n in zip(ids, (5, 13, 9))]
    want, _ = popjax.generate_ids(model, prompts, max_new_tokens=6, method=method, ignore_eos=True)
    got, _ = popjax.generate_ids(reloaded, prompts, max_new_tokens=6, ignore_eos=True)
    assert got == want


def test_flap_bias_compensates_the_pruned_channels(model, calibrated):
    """The pruned model's down bias is exactly the calibrated b_l (and not zero)."""
    method = calibrated["flap"]
    pruned = prune_model(model, method)
    for i, bias in enumerate(method.selection.bias):
        got = np.asarray(_mlp(pruned, i)["down_bias"])
        np.testing.assert_array_equal(got, np.asarray(bias, np.float32))
        assert np.abs(got).max() > 0


def test_methods_on_a_pruned_model(model, calibrated):
    """Per-layer widths: only dense runs; a Wanda-sp model (uniform, smaller f) takes any method."""
    flap_model = prune_model(model, calibrated["flap"])
    assert Dense().bind(flap_model.config).name == "dense"
    for method in (WandaSP(0.2), FLAP(0.2)):
        with pytest.raises(MethodError, match="per-layer widths"):
            method.bind(flap_model.config)
    wanda_model = prune_model(model, calibrated["wanda-sp"])
    plan = POP(0.1).bind(wanda_model.config)
    assert plan.f == kept_channels(model.config, 0.3)


@pytest.mark.parametrize("method", [GRIFFIN(0.2), ProbePruning(0.2), POP(0.2), Static(0.2)])
def test_ratio_methods_refuse_per_layer_widths(model, calibrated, method):
    """RatioMethod.bind's check (popjax/methods/base.py): their plans assume one f."""
    with pytest.raises(MethodError, match="per-layer widths"):
        method.bind(prune_model(model, calibrated["flap"]).config)


def test_prune_model_calibrates_when_needed(model, tmp_path):
    corpus = random_corpus(model.config.vocab_size, seed=3)
    pruned = prune_model(model, WandaSP(0.3), corpus, cache_dir=tmp_path)
    direct = prune_model(model, WandaSP(0.3).calibrate(model, corpus, cache_dir=tmp_path))
    ids = _ids(model, 1)
    np.testing.assert_array_equal(np.asarray(popjax.forward(pruned, ids)), np.asarray(popjax.forward(direct, ids)))
    assert prune_model(model, WandaSP(0.0)) is model  # nothing to prune


# ------------------------------------------------------------------ bad input


def test_flap_ratio_below_every_layers_floor(model):
    """ratio 0.59 keeps n_keep = 2 of 96 channels; the 5% floor needs 5 in every layer."""
    with pytest.raises(MethodError, match=r"ratio=0\.59 keeps n_keep=2 .* floor of 5"):
        FLAP(0.59).bind(model.config)
    with pytest.raises(MethodError, match=r"ratio=0\.59"):
        FLAP(0.59).calibrate(model, random_corpus(model.config.vocab_size))
    assert FLAP(0.59, min_keep=0.0).n_keep(model.config) == 2  # a floor of one channel meets it
    with pytest.raises(MethodError, match="min_keep=1.5"):
        FLAP(0.2, min_keep=1.5)


def test_calibration_corpus_missing_or_empty(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-corpus.txt"):
        WandaSP(0.3).calibrate(model, tmp_path / "no-such-corpus.txt")
    with pytest.raises(CalibrationError, match="'tiny' is empty"):
        FLAP(0.3).calibrate(model, Corpus.from_token_ids("tiny", [5, 6, 7], window=32))
    with pytest.raises(MethodError, match="corpus=42"):
        FLAP(0.3).calibrate(model, 42)


def test_uncalibrated_or_mismatched_selection(model, calibrated):
    with pytest.raises(MethodError, match=r"calibrate\(model\)"):
        WandaSP(0.3).bind(model.config)
    with pytest.raises(MethodError, match=r"calibrate\(model\)"):  # its data (the kept ids) checks alike
        WandaSP(0.3).data(model)
    stale = FLAP(0.3, selection=calibrated["flap"].selection)
    with pytest.raises(MethodError, match=f"ratio={FLAP_RATIO}"):
        stale.bind(model.config)
    with pytest.raises(MethodError, match="offline method"):
        prune_model(model, POP(0.2))
    with pytest.raises(MethodError, match="batch_size"):
        WandaSP(0.3).calibrate(model, random_corpus(model.config.vocab_size), batch_size=2)


def test_save_pruned_refuses_an_existing_directory(model, calibrated, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken"):
        save_pruned(prune_model(model, calibrated["wanda-sp"]), tmp_path / "taken")


def test_config_rejects_bad_layer_widths(model):
    raw = model.config.to_hf_dict()
    assert "intermediate_sizes" not in raw and "down_proj_bias" not in raw  # unpruned configs unchanged
    for bad in ([10], [10, 0], "wide", [10, 2.5]):
        with pytest.raises(ConfigError, match="intermediate_sizes="):
            ModelConfig.from_hf_dict({**raw, "intermediate_sizes": bad})
    cfg = ModelConfig.from_hf_dict({**raw, "intermediate_sizes": [40, 56], "down_proj_bias": True})
    assert (cfg.ffn_width(0), cfg.ffn_width(1), cfg.down_proj_bias) == (40, 56, True)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
