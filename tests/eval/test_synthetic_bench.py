"""``popjax bench --synthetic``: random weights of a config drawn on the device, timed through
the same benchmark (no timing is asserted: bytes, shapes and the JSON's structure are)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from popjax.bench import synthetic
from popjax.cli import main
from popjax.methods import parse_method_spec

TINY = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def test_synthetic_model_has_the_configs_shapes_and_format(tiny_config):
    cfg = synthetic.synthetic_config(str(tiny_config), layers=2, weights="int8")
    model = synthetic.synthetic_model(cfg, "float32")
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(model.params)}
    assert cfg.num_hidden_layers == 2 and "layers.1.mlp.gate_up" in flat and "layers.2.mlp.gate_up" not in flat
    assert flat["layers.0.mlp.gate_up"].dtype == jnp.int8 and flat["layers.0.mlp.gate_up"].shape == (2, 256, 128)
    assert flat["layers.0.mlp.down_scale"].dtype == jnp.float32
    assert np.unique(np.asarray(flat["layers.0.mlp.gate_up"])).size > 200  # drawn, not a constant
    # the derived constant loading computes (‖W_d[:, j]‖₂ of the dequantized down) is computed here too
    down = np.asarray(flat["layers.0.mlp.down"], np.float32) * np.asarray(flat["layers.0.mlp.down_scale"])
    np.testing.assert_allclose(np.asarray(flat["layers.0.mlp.down_norm"]), np.linalg.norm(down, axis=0), rtol=1e-5)
    assert flat["layers.0.mlp_norm.weight"].min() == 1.0  # norms start at one


def test_offline_methods_get_placeholder_fits_and_say_so(tiny_config):
    cfg = synthetic.synthetic_config(str(tiny_config))
    teal, pop = parse_method_spec("teal:ratio=0.4"), parse_method_spec("pop:ratio=0.4")
    assert synthetic.fitted(teal, cfg).thresholds is not None and "placeholder" in synthetic.fit_note(teal, cfg)
    assert synthetic.fit_note(synthetic.fitted(teal, cfg), cfg) == synthetic.fit_note(teal, cfg)  # noted after fitting too
    assert synthetic.fitted(pop, cfg) is pop and synthetic.fit_note(pop, cfg) is None


@pytest.mark.parametrize("argv, message", [
    (["--synthetic", "no-such-model"], "neither a published config"),
    (["--synthetic", "llama-3.1-8b", "--layers", "0"], r"layers=0 is invalid for llama-3.1-8b \(32 layers\)"),
    (["--layers", "2"], "give --synthetic MODEL too"),
    (["--synthetic", "llama-3.1-8b", "--layers", "1", "--dtype", "float16", "--batches", "1"], "dtype='float16' is not a compute dtype"),
    (["--synthetic", "llama-3.1-8b", "--suites", "lengths"], "a --synthetic model has none"),
])
def test_bad_synthetic_flags_fail_in_one_line(capsys, argv, message):
    assert main(["bench", *argv, "--no-transformers"]) == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_synthetic_bench_writes_json(tmp_path, tiny_config):
    path = tmp_path / "bench.json"
    code = main(["bench", "--synthetic", str(tiny_config), "--layers", "2", "--weights", "float,int8", "--methods", "pop,teal",
                 "--ratios", "0.4", "--batches", "1", "--repeats", "1", "--max-new-tokens", "4", "--json", str(path)])
    assert code == 0
    result = json.loads(path.read_text())
    assert result["model"] == f"synthetic:{tiny_config}" and result["synthetic"]["layers"] == 2 and result["peers"] == {}
    records = {(r["method"], r["weights"]): r for r in result["records"]}
    assert set(records) == {(m, w) for m in ("dense", "pop", "teal") for w in ("float", "int8")}
    assert "placeholder" in records["teal", "int8"]["fits"] and records["pop", "float"]["fits"] is None
    # the analytic bytes: int8 weights are read as one byte each
    assert records["dense", "int8"]["bytes_per_step"] < 0.5 * records["dense", "float"]["bytes_per_step"]
    assert all(r["recompiles_across_20_prompts"] == 0 for r in result["records"])
