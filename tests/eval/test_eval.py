"""The evaluation harness: teacher forcing, the sandboxed HumanEval runner, and one small sweep."""

from __future__ import annotations

import json

import numpy as np
import pytest

import popjax
from popjax.data import humaneval_problems
from popjax.eval.sandbox import run_python
from popjax.eval.tasks import HumanEvalSettings, run_problems, truncate_completion
from popjax.eval.teacher import teacher_forced
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    directory, _ = tiny_checkpoints("qwen2-bias")
    return popjax.load(directory, cache=False)


def _forward_nll(model, prompt, targets):
    ids = prompt + list(targets)
    logits = np.asarray(popjax.forward(model, [ids]))[0].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    return np.array([-logp[len(prompt) - 1 + i, t] for i, t in enumerate(targets)])


def test_dense_teacher_forced_nll_equals_full_forward(tiny_model):
    rng = np.random.default_rng(0)
    vocab = tiny_model.config.vocab_size
    prompts = random_prompts(rng, (9, 4, 15), vocab)
    targets = np.array(random_prompts(rng, (12, 12, 12), vocab))
    nll, _ = teacher_forced(tiny_model, popjax.Dense(), prompts, targets)
    for row, prompt in enumerate(prompts):
        np.testing.assert_allclose(nll[row], _forward_nll(tiny_model, prompt, targets[row]), atol=1e-4)


class _CharTokenizer:
    """Characters to ids in the tiny model's vocabulary (for tasks that tokenize text)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 150 for c in text]}


def test_code_nll_scores_the_canonical_solutions_through_the_decode_path(tiny_model):
    import dataclasses

    from popjax.eval.tasks import CodeNLLSettings, code_nll

    model = dataclasses.replace(tiny_model, tokenizer=_CharTokenizer())
    problems = [{"prompt": "def f(x):\n", "canonical_solution": "    return x + 1\n"},
                {"prompt": "def g(a, b):\n    # add\n", "canonical_solution": "    return a+b\n"}]
    got = code_nll(model, popjax.Dense(), problems, CodeNLLSettings(max_tokens=12, batch_size=2))
    tok = model.tokenizer
    want = np.concatenate([
        _forward_nll(tiny_model, tok(p["prompt"])["input_ids"], tok(p["canonical_solution"])["input_ids"][:12])
        for p in problems
    ])
    assert got["code_tokens"] == 24
    np.testing.assert_allclose(got["code_nll"], want.mean(), atol=1e-4)


def test_pruned_teacher_forcing_differs_from_dense(tiny_model):
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, (8, 8), tiny_model.config.vocab_size)
    targets = np.array(random_prompts(rng, (6, 6), tiny_model.config.vocab_size))
    dense, _ = teacher_forced(tiny_model, popjax.Dense(), prompts, targets)
    pop, _ = teacher_forced(tiny_model, popjax.POP(ratio=0.3), prompts, targets)
    assert np.abs(dense - pop).max() > 1e-3


def test_humaneval_runner_passes_canonical_and_fails_wrong_solutions():
    problems = humaneval_problems(4)
    settings = HumanEvalSettings(timeout_s=5.0)
    canonical = run_problems(problems, [p["canonical_solution"] for p in problems], settings)
    assert canonical == [True] * 4
    wrong = run_problems(problems, ["    return None\n"] * 4, settings)
    assert wrong == [False] * 4


def test_infinite_loop_is_stopped_by_the_timeout():
    problem = humaneval_problems(1)[0]
    result = run_python(problem["prompt"] + "    while True:\n        pass\n\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n", timeout_s=2.0)
    assert (result.passed, result.reason) == (False, "timeout")


def test_memory_hog_is_stopped_by_the_limit():
    result = run_python("x = bytearray(4 << 30)\n", timeout_s=10.0, memory_mb=512)
    assert not result.passed and "MemoryError" in result.stderr_tail


def test_truncate_completion_stops_at_the_next_definition():
    text = "    return a + b\n\n\ndef other():\n    pass\n"
    assert truncate_completion(text) == "    return a + b\n\n"


@pytest.mark.slow  # the real default model, cut to two layers (its widths, weights and tokenizer)
def test_eval_command_writes_records_table_and_plots(tmp_path, capsys, short_default_model_dir):
    from popjax.cli import main

    out, path = tmp_path / "report", tmp_path / "eval.json"
    code = main([
        "eval", "--model", str(short_default_model_dir), "--methods", "dense,pop", "--ratios", "0.2", "--tasks", "nll,fidelity",
        "--nll-prompt-tokens", "32", "--nll-decode-tokens", "16", "--nll-windows", "2",
        "--fidelity-tokens", "8", "--fidelity-instructions", "2", "--fidelity-humaneval", "1", "--batch-size", "2",
        "--scan-layers",  # one layer's code per program: a fraction of the unrolled model's trace and compile time
        "--json", str(path), "--out", str(out),
    ])
    assert code == 0
    records = json.loads(path.read_text())["records"]
    assert {(r["method"], r["task"]) for r in records} == {(m, t) for m in ("dense", "pop") for t in ("nll", "fidelity")}
    by = {(r["method"], r["task"]): r for r in records}
    assert by[("dense", "fidelity")]["agreement"] == 1.0 and by[("dense", "fidelity")]["kl"] < 1e-6
    assert by[("pop", "nll")]["ratio"] == 0.2 and len(by[("pop", "nll")]["nll_by_position"]) == 16
    assert 0 < by[("pop", "nll")]["ffn_flops_overhead_vs_static"] < 0.04
    assert (out / "report.md").is_file() and (out / "nll_by_position.png").stat().st_size > 1000
    assert "| pop | 0.20 |" in capsys.readouterr().out  # per-sequence: the default, so no label suffix


def test_eval_rejects_unknown_task_and_method():
    from popjax.cli import main

    assert main(["eval", "--tasks", "mmlu"]) == 2
    assert main(["eval", "--methods", "no-such-method"]) == 2
