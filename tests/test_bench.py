"""The benchmark command runs end to end and writes its JSON (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from popjax.analysis.flops import bytes_per_step
from popjax.cli import main
from popjax.models import ModelConfig
from tests.test_pop_model import SMOLLM2


def test_bytes_per_step_follow_the_kept_channels():
    import popjax

    cfg = ModelConfig.from_hf_dict(SMOLLM2)
    dense = bytes_per_step(cfg, popjax.Dense().bind(cfg), 1, 96, 4)
    static = bytes_per_step(cfg, popjax.Static(ratio=0.4).bind(cfg), 1, 96, 4)
    pop = bytes_per_step(cfg, popjax.POP(ratio=0.4).bind(cfg), 1, 96, 4)
    assert static < pop < dense
    assert abs(dense / 4 - (30 * (cfg.attention_params_per_layer() + cfg.mlp_params_per_layer()) + 49152 * 576 + 2 * 30 * 96 * 192)) < 1


@pytest.mark.slow  # benchmarks the real default model
def test_bench_command_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    code = main([
        "bench", "--methods", "pop", "--ratios", "0.2", "--batches", "1", "--max-new-tokens", "4",
        "--repeats", "1", "--no-transformers", "--scan-layers", "--json", str(path),
    ])
    assert code == 0
    result = json.loads(path.read_text())
    assert result["bandwidth_gb_s"] > 0 and result["scan_layers"] is True  # scanned: the faster compile
    keys = {"method", "ratio", "batch", "decode_tokens_per_s", "ttft_s", "roofline_fraction", "recompiles_across_20_prompts"}
    assert {(r["method"], r["ratio"], r["batch"]) for r in result["records"]} == {("dense", 0.0, 1), ("pop", 0.2, 1)}
    for record in result["records"]:
        assert keys <= set(record) and record["recompiles_across_20_prompts"] == 0
