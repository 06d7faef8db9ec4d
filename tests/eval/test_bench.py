"""The benchmark command runs end to end and writes its JSON (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from popjax.analysis.flops import bytes_per_step
from popjax.bench.runner import MethodRun, format_table
from popjax.cli import main
from popjax.models import ModelConfig
from tests.reference.lm import SMOLLM2


def test_bytes_per_step_follow_the_kept_channels():
    import popjax

    cfg = ModelConfig.from_hf_dict(SMOLLM2)
    dense = bytes_per_step(cfg, popjax.Dense().bind(cfg), 1, 96, 4)
    static = bytes_per_step(cfg, popjax.Static(ratio=0.4).bind(cfg), 1, 96, 4)
    pop = bytes_per_step(cfg, popjax.POP(ratio=0.4).bind(cfg), 1, 96, 4)
    assert static < pop < dense
    assert abs(dense / 4 - (30 * (cfg.attention_params_per_layer() + cfg.mlp_params_per_layer()) + 49152 * 576 + 2 * 30 * 96 * 192)) < 1


@pytest.mark.slow  # the real default model, cut to two layers (its widths, weights and tokenizer)
def test_bench_command_writes_json(tmp_path, short_default_model_dir):
    path = tmp_path / "bench.json"
    code = main([
        "bench", "--model", str(short_default_model_dir), "--methods", "pop", "--ratios", "0.2", "--batches", "1", "--max-new-tokens", "4",
        "--repeats", "1", "--no-transformers", "--scan-layers", "--json", str(path),
    ])
    assert code == 0
    result = json.loads(path.read_text())
    assert result["bandwidth_gb_s"] > 0 and result["scan_layers"] is True  # scanned: the faster compile
    keys = {"method", "ratio", "batch", "decode_tokens_per_s", "ttft_s", "roofline_fraction", "recompiles_across_20_prompts"}
    assert {(r["method"], r["ratio"], r["batch"]) for r in result["records"]} == {("dense", 0.0, 1), ("pop", 0.2, 1)}
    for record in result["records"]:
        assert keys <= set(record) and record["recompiles_across_20_prompts"] == 0


def test_int8_bytes_and_weight_formats_in_the_table():
    """An int8 model's step reads one byte per weight (LM head included) and caches in the
    compute dtype; the bench validates its weight formats and tables both formats and every peer."""
    import dataclasses

    import popjax
    from popjax.bench.runner import BenchSettings, format_table

    cfg = ModelConfig.from_hf_dict(SMOLLM2)
    int8 = dataclasses.replace(cfg, weights="int8")
    plan = popjax.Dense().bind(cfg)
    weights = 30 * (cfg.attention_params_per_layer() + cfg.mlp_params_per_layer()) + 49152 * 576
    kv = 2 * 30 * 96 * 192 * 4
    assert bytes_per_step(cfg, plan, 1, 96, 4) == 4 * weights + kv
    assert bytes_per_step(int8, plan, 1, 96, 4) == weights + kv
    with pytest.raises(ValueError, match=r"weights=\['int4'\]: 'int4' is not a weight format; choose from float, int8"):
        BenchSettings(weights=["int4"])
    rec = lambda w, tps: {"method": "dense", "label": "dense", "weights": w, "ratio": 0.0, "batch": 1, "decode_tokens_per_s": tps,
                          "roofline_tokens_per_s": 100.0, "roofline_fraction": tps / 100, "ttft_s": 0.1, "compile_s": 1.0}
    peers = {"transformers": {"engine": "transformers fp32", "by_batch": {"1": {"decode_tokens_per_s": 10.0}}},
             "llama_cpp": {"engine": "llama.cpp", "by_batch": {"1": {"decode_tokens_per_s": 50.0}}}}
    table = format_table({"bandwidth_gb_s": 30.0, "records": [rec("float", 40.0), rec("int8", 60.0)],
                          "transformers": peers["transformers"], "peers": peers})
    assert "| dense | int8 | 0.00 | 1 | 60.0 | 1.00 | 1.50 | 6.00 |" in table
    assert "llama.cpp, batch 1: 50.0 tok/s" in table


def test_a_decode_too_short_to_time_is_no_speed():
    """A generate no longer than its prefill gives no tokens/s (None in the JSON, n/m in the
    table), never the absurd rate of a near-zero difference."""
    run = MethodRun.__new__(MethodRun)
    run.batch, run.max_new_tokens, run.first_s, run.compiles = 1, 4, 2.0, 1
    run.ttft, run.total = [0.50, 0.52], [0.49, 0.52]  # decode: -0.01 and 0.0
    assert run.stats()["decode_tokens_per_s"] is None
    run.total = [0.80, 0.82]
    assert run.stats()["decode_tokens_per_s"] == pytest.approx(3 / 0.30)
    record = dict(method="dense", label="dense", weights="float", ratio=0.0, batch=1, decode_tokens_per_s=None,
                  roofline_tokens_per_s=30.0, roofline_fraction=None, ttft_s=0.5, compile_s=1.0)
    table = format_table({"bandwidth_gb_s": 20.0, "records": [record], "transformers": None, "peers": {}})
    assert "| n/m | n/m |" in table and "raise --max-new-tokens" in table
