"""Issue 41's before/after check, as a by-hand command: every registry method on a tiny random
model of each family (LLaMA, Qwen2, Qwen3, Qwen2-MoE, Gemma 3, Qwen2-VL with an image), unrolled
and scanned, gives the greedy tokens and teacher-forced log-probs that `tools/method_equivalence.py`
recorded in ``tests/data/method_equivalence_tiny.json`` on the code before the refactor:

    python tools/method_equivalence.py --compare tests/data/method_equivalence_tiny.json --tol 1e-5

(the whole matrix, 5 models x 27 runs x 2 layouts, about 8 CPU-minutes; its last run:
results/seam/equivalence.json; ``--diagonal --layouts unrolled`` runs each reference run once,
about 50 CPU-seconds). 1e-5, not 1e-6: tokens are identical, but the unrolled decode attends to
the cache and then to the fresh tokens in two online-softmax blocks (the order the scanned path
already used), so log-probs move by up to 8 fp32 ulps (1.91e-6 measured).

The refactor has landed and the suite no longer runs the comparison: its reference is the code
before it, so a deliberate change of a method's arithmetic could never pass it again. What holds
the methods now: their NumPy references (tests/methods/test_methods_reference.py,
test_baselines_reference.py, test_anchor_methods.py, Gemma 3's and MoE's), the method x
architecture matrix (test_method_matrix.py) and the scanned = unrolled checks
(tests/models/test_scan.py). These tests check the comparison itself, its argument errors, the
reference's coverage and the diagonal's.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "method_equivalence.py"
REFERENCE = ROOT / "tests" / "data" / "method_equivalence_tiny.json"


def _tool(name: str = "method_equivalence"):
    """tools/<name>.py as a module (tools/ is no package); neither tool imports jax at the top.
    "equivalence_report": the comparison half."""
    spec = importlib.util.spec_from_file_location(name, TOOL.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference() -> dict:
    return json.loads(REFERENCE.read_text())


def _labels() -> list[str]:
    """The reference's runs (method and hyper-parameters) over all tiny models, sorted."""
    return sorted({label for entries in _reference()["models"].values() for label in entries})


# ----------------------------------------------------------------------------- the comparison (fast)


def _run(tool, tokens=((5, 6), (7, 8)), logp=(-1.0, -2.0)) -> dict:
    logp = np.asarray(logp, np.float32)
    return {"tokens": [list(t) for t in tokens], "argmax": [[1, 2]], "target_logprob": tool.encode(logp),
            "argmax_logprob": tool.encode(logp)}


def test_equal_runs_pass_and_are_bit_identical():
    tool = _tool("equivalence_report")
    row = tool.compare_run(_run(tool), _run(tool), 1e-6)
    assert row["ok"] and row["bit_identical"] and row["max_abs_dlogprob"] == 0.0


def test_a_changed_token_or_log_prob_fails():
    tool = _tool("equivalence_report")
    assert not tool.compare_run(_run(tool), _run(tool, tokens=((5, 6), (7, 9))), 1e-6)["ok"]
    moved = tool.compare_run(_run(tool), _run(tool, logp=(-1.0, -2.0 + 4e-6)), 1e-6)
    assert not moved["ok"] and moved["tokens_equal"] and moved["max_abs_dlogprob"] == pytest.approx(4e-6, rel=0.1)
    assert tool.compare_run(_run(tool), _run(tool, logp=(-1.0, -2.0 + 4e-6)), 1e-5)["ok"]  # the tolerance is a flag


def test_a_run_that_errors_now_fails_and_one_that_errored_before_passes():
    tool = _tool("equivalence_report")
    assert not tool.compare_run(_run(tool), {"error": "ValueError: x"}, 1e-6)["ok"]
    assert tool.compare_run({"error": "ValueError: x"}, _run(tool), 1e-6)["ok"]
    report = tool.compare({"models": {"m": {"pop": {"method": {}, "unrolled": _run(tool)}}}},
                          {"models": {"m": {"pop": {"method": {}, "unrolled": {"error": "E: y"}}}}}, 1e-6)
    assert report["failed"] == ["m pop unrolled"] and report["runs"] == 1


def test_a_scanned_run_the_reference_could_not_make_is_held_to_its_unrolled_run():
    tool = _tool("equivalence_report")
    reference = {"models": {"m": {"p": {"method": {}, "unrolled": _run(tool), "scanned": {"error": "E: no"}}}}}
    same = tool.compare(reference, {"models": {"m": {"p": {"method": {}, "scanned": _run(tool)}}}}, 1e-6)
    assert not same["failed"] and same["results"]["m p scanned"]["against"] == "unrolled"
    other = {"models": {"m": {"p": {"method": {}, "scanned": _run(tool, tokens=((5, 6), (7, 1)))}}}}
    assert tool.compare(reference, other, 1e-6)["failed"] == ["m p scanned"]


@pytest.mark.parametrize("argv, message", [
    ([], "give --record OUT.json and/or --compare REF.json"),
    (["--record", "x.json", "--models", "gpt2"], r"--models: \['gpt2'\] is not valid; valid: \['llama'"),
    (["--record", "x.json", "--models", "default,llama"], "run 'default' alone"),
    (["--record", "x.json", "--diagonal"], "--diagonal: give --compare REF.json"),
    (["--record", "x.json", "--layouts", "flat"], r"--layouts: \['flat'\] is not valid; valid: \['unrolled', 'scanned'\]"),
    (["--compare", str(REFERENCE), "--methods", "pop"], r"--methods: \['pop'\] is not valid; valid: \["),
    (["--compare", str(REFERENCE), "--models", "default"], r"--models: \['default'\] is not valid"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    """Checked before jax would start (this process has it already: the tool refuses to run here)."""
    tool = _tool()
    with pytest.raises(SystemExit) as err:
        tool.plan(tool.parse_args(argv))
    text = str(err.value) if not isinstance(err.value.code, int) else capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, text) and "\n" not in text, text


def test_the_reference_covers_every_family_layout_and_method_with_its_aggregate_pinned():
    from popjax.methods import METHODS, method_fields

    tool, reference = _tool(), _reference()
    assert REFERENCE.stat().st_size < 300_000
    assert list(reference["models"]) == list(tool.TINY_MODELS)
    for model, entries in reference["models"].items():
        names = {e["method"]["name"].split("+")[0] for e in entries.values()}
        assert names == set(METHODS), (model, sorted(set(METHODS) ^ names))
        for label, entry in entries.items():
            spec = entry["method"]
            if "aggregate" in method_fields(spec["name"].split("+")[-1]):
                assert "aggregate" in spec["hyper"], (model, label)  # a changed default is no regression
            ran = [layout for layout in tool.LAYOUTS if "error" not in entry[layout]]
            assert "unrolled" in ran, (model, label, entry["unrolled"])


def test_the_diagonal_covers_every_run_of_the_reference_once():
    tool, reference = _tool(), _reference()
    runs = [label for m in reference["models"] for label in tool.diagonal(reference, m)]
    assert sorted(runs) == _labels() and len(runs) == len(set(runs))
