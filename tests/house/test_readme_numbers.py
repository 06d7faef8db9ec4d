"""The README's and docs' generated speed tables equal what tools/readme_numbers.py renders from
the results/ JSON: a number in the text cannot drift from its result file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import readme_numbers  # noqa: E402  (a developer tool, not part of the package)


def test_generated_blocks_match_their_results():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_numbers.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_speed_table_reads_the_bench_records():
    bench = {"records": [{"method": "dense", "ratio": 0.0, "batch": 1, "weights": "float", "decode_tokens_per_s": 40.0},
                         {"method": "pop", "ratio": 0.4, "batch": 1, "weights": "float", "decode_tokens_per_s": 50.0}],
             "transformers": {"engine": "transformers fp32", "by_batch": {"1": {"decode_tokens_per_s": 30.0}}},
             "bandwidth_gb_s": 20.0, "max_new_tokens": 64, "repeats": 3}
    table = readme_numbers.speed_table(bench)
    assert "| pop 40% | fp32 | 50.0 (1.25×) |" in table
    assert "| transformers fp32 (peer) | — | 30.0 |" in table


def test_a_stale_block_is_reported_and_a_missing_one_is_an_error():
    text = "a\n<!-- generated: x -->\nold\n<!-- end generated: x -->\nb"
    assert readme_numbers.render(text, "x", "new") == "a\n<!-- generated: x -->\nnew\n<!-- end generated: x -->\nb"
    with pytest.raises(ValueError, match=r"no generated block 'y'"):
        readme_numbers.render(text, "y", "new")
