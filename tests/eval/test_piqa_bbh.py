"""PIQA and BIG-Bench Hard from their own files (fixtures: the first questions of each, in the
repositories' formats, under tests/data/): prompts and answer sets, lm-eval's metrics, the two
routes (popjax eval and popjax lm-eval with lm-eval's own piqa task) agreeing on a tiny model,
and one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lm_eval
import numpy as np
import pytest

import popjax
from popjax.cli import main
from popjax.eval import bbh, bigbench as bb, piqa
from popjax.eval.bigbench_score import batch_shapes, choice_buckets, choice_logprobs, evaluate_task, lm_eval_scores
from popjax.eval.lm_eval_adapter import PopjaxLM, task_manager_for

DATA = Path(__file__).parents[1] / "data"


def test_piqa_questions_are_lm_evals_prompts():
    task = piqa.PiqaTask.load(DATA)
    queries = task.queries(limit=3)
    assert len(queries) == 3 and len(task.queries()) == 6  # --limit: the first N
    assert queries[1].prompt == "Question: dresser\nAnswer:"
    assert queries[1].texts == (" replace drawer with bobby pin ", " finish, woodgrain with  bobby pin ")
    assert [q.scores for q in queries] == [(1.0, 0.0), (0.0, 1.0), (0.0, 1.0)]  # labels 0, 1, 1
    with pytest.raises(ValueError, match="PIQA is scored zero-shot"):
        task.queries(shots=1)


def test_lm_eval_metrics_first_argmax_and_length_without_the_delimiter():
    q = bb.Query("p", ("ab", "abcd"), (1.0, 0.0), "t", absolute=True, delimiter=" ", first_argmax=True)
    # acc_norm divides by len(choice) without the delimiter: -2.2/2 = -1.1 < -4.0/4 = -1.0 -> choice 1 (wrong);
    # with the delimiter counted (3, 5) it would pick choice 0
    assert bb.norm_correct(q, np.array([-2.2, -4.0])) == 0.0
    assert bb.grade(q, np.array([-1.0, -1.0])) == 1.0  # a tie: lm-eval takes the first maximum
    assert bb.grade(q, np.array([-3.0, -1.0])) == 0.0


def test_bbh_answer_sets_and_prompts():
    navigate = bbh.load_task("bbh:navigate", DATA)
    first = navigate.queries()[0]
    assert navigate.label == "bbh:navigate" and navigate.chance == 0.5
    assert first.prompt.startswith("Q: If you follow these instructions") and first.prompt.endswith("- No\nA: ")
    assert first.choices == ("No", "Yes") and first.scores == (1, 0)  # the task's two answers; target No
    date = bbh.load_task("date_understanding", DATA).queries()[0]
    assert date.choices == ("(A)", "(B)", "(C)", "(D)", "(E)", "(F)") and date.scores[1] == 1  # the options listed
    shot = bbh.load_task("navigate", DATA, fewshot=True)
    prompt = shot.queries()[0].prompt
    assert shot.label == "bbh:navigate-3shot" and prompt.startswith("Given a series of navigation instructions")
    assert prompt.count("\nA: ") == 4 and "Let's think" not in prompt and "So the answer" not in prompt
    assert "Take 4 steps. Take 8 steps.\nOptions:\n- Yes\n- No\nA: No\n\nQ: " in prompt  # an exemplar cut to its answer
    assert prompt.endswith(first.prompt)


def test_bbh_and_piqa_errors_name_the_value_and_the_source(tmp_path):
    with pytest.raises(bb.NoMultipleChoice, match="'object_counting' has free-form answers"):
        bbh.load_task("object_counting", DATA)
    with pytest.raises(FileNotFoundError, match="unknown BBH task 'navigat'.*: date_understanding, navigate$"):
        bbh.load_task("navigat", DATA)
    with pytest.raises(FileNotFoundError, match="needs DIR/bbh/NAME.json from github:suzgunmirac/BIG-Bench-Hard"):
        bbh.load_task("navigate", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"valid.jsonl does not exist.*github:ybisk/ybisk.github.io \(folder piqa/data/"):
        piqa.PiqaTask.load(tmp_path)
    (tmp_path / "piqa").mkdir()
    shutil.copy(DATA / "piqa" / "valid.jsonl", tmp_path / "piqa")
    (tmp_path / "piqa" / "valid-labels.lst").write_text("0\n1\n")
    with pytest.raises(ValueError, match="has 6 questions but .* has 2 labels"):
        piqa.PiqaTask.load(tmp_path)
    with pytest.raises(ValueError, match="without 'A: ... So the answer is X."):
        bbh.answer_only_prompt("canary\n-----\nDescribe.\n\nQ: x?\nA: Let's think. No answer here", "toy")
    assert main(["eval", "--tasks", "piqa", "--methods", "dense"]) == 2  # before any model loads


def test_batch_shapes_follow_lengths_but_merge_where_padding_is_cheap():
    # bucket 4 -> 32 would pad 4 batches by 28 steps each (112 > MERGE_PADDING): kept apart
    assert choice_buckets([3, 3, 3, 3, 20, 20, 20, 20]) == [4] * 4 + [32] * 4
    assert choice_buckets([3, 3, 3, 7, 7]) == [8] * 5  # 3 batches × 4 steps: one program instead of two
    assert choice_buckets([3, 20, 20, 200]) == [32, 32, 32, 256]
    # prompt buckets first (one batch 32 -> 64 pads 32 positions: merged), then choices within each
    assert batch_shapes([30, 40, 40, 40, 40], [3, 3, 3, 7, 7]) == [(64, 8)] * 5
    assert batch_shapes([30, 30, 200], [3, 3, 3]) == [(32, 4), (32, 4), (256, 4)]


def test_piqa_scores_equal_lm_evals_own_task(model, tmp_path):
    """popjax's scorer against lm-eval running its own piqa.yaml on the same files: the same
    (context, continuation) strings, log-likelihoods, acc and acc_norm."""
    method = popjax.POP(ratio=0.3, aggregate="per_sequence")
    task = piqa.PiqaTask.load(DATA)
    ours = evaluate_task(model, method, task, limit=5, batch_size=2)
    name = piqa.write_lm_eval_task(DATA, tmp_path / "tasks")
    lm = PopjaxLM.from_loaded(model, method, batch_size=2, uniform_shapes=True)  # one compile
    out = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=task_manager_for([name], str(tmp_path / "tasks"), False),
                                  limit=5, bootstrap_iters=0, log_samples=True)
    samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
    queries = task.queries(limit=5)
    assert [tuple(tuple(a) for a in s["arguments"]) for s in samples] == [tuple((q.prompt, t) for t in q.texts) for q in queries]
    for got, s in zip(choice_logprobs(model, method, queries, batch_size=2), samples):
        np.testing.assert_allclose(got, [float(r[0]) for r in s["filtered_resps"]], atol=2e-4)
    scores = out["results"][name]
    assert (scores["acc,none"], scores["acc_norm,none"]) == (ours["acc"], ours["acc_norm"])


def test_piqa_commands_agree(converted, tmp_path):
    """``popjax eval --tasks piqa`` and ``popjax lm-eval --tasks piqa``, both with --data-dir."""
    mine, theirs = tmp_path / "eval.json", tmp_path / "lm_eval.json"
    assert main(["eval", "--model", str(converted), "--tasks", "piqa", "--data-dir", str(DATA), "--methods", "pop", "--ratios", "0.3",
                 "--limit", "5", "--batch-size", "2", "--json", str(mine)]) == 0
    assert main(["lm-eval", "--model", str(converted), "--tasks", "piqa", "--data-dir", str(DATA), "--method", "pop", "--ratio", "0.3",
                 "--limit", "5", "--batch-size", "2", "--bootstrap-iters", "0", "--json", str(theirs)]) == 0
    record = next(r for r in json.loads(mine.read_text())["records"] if r["method"] == "pop")
    result = json.loads(theirs.read_text())["results"][piqa.LM_EVAL_TASK]
    assert record["examples"] == 5 and (record["acc"], record["acc_norm"]) == (result["acc,none"], result["acc_norm,none"])


def test_bbh_routes_agree(model, tmp_path):
    task = bbh.load_task("date_understanding", DATA, fewshot=True)
    method = popjax.Dense()
    ours = evaluate_task(model, method, task, batch_size=2)
    theirs = lm_eval_scores(model, method, task, tmp_path, batch_size=2)
    for a, b in zip(choice_logprobs(model, method, task.queries(), batch_size=2), theirs["logprobs"]):
        np.testing.assert_allclose(a, b, atol=2e-4)
    assert ours["task"] == "bbh:date_understanding-3shot" and ours["examples"] == 6
    assert (theirs["acc"], theirs["acc_norm"]) == (ours["acc"], ours["acc_norm"])
