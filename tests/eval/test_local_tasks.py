"""The local lm-eval task built from a real play (``shakespeare_next_line``): documents are
deterministic and well formed, the YAML runs offline through lm-eval, and ``popjax eval``'s
``next_line`` task scores it for a method."""

from __future__ import annotations

import pytest

import popjax
from popjax.data import DEV_PLAY, load_play
from popjax.eval.harness import EvalSettings, evaluate
from popjax.eval.local_tasks import CHOICES, is_verse, next_line_documents, play_lines, write_task



@pytest.fixture(scope="module")
def text():
    return load_play(DEV_PLAY)


def test_documents_are_deterministic_and_well_formed(text):
    docs = next_line_documents(text, n=12, context_lines=3, seed=1)
    assert docs == next_line_documents(text, n=12, context_lines=3, seed=1)
    assert docs != next_line_documents(text, n=12, context_lines=3, seed=2)
    lines = play_lines(text)
    for doc in docs:
        assert len(doc["choices"]) == CHOICES and len(set(doc["choices"])) == CHOICES
        gold = doc["choices"][doc["label"]]
        assert is_verse(gold)
        context = doc["context"].rstrip("\n").split("\n")
        assert len(context) == 3
        # the gold line really follows the context in the play
        starts = [i for i in range(len(lines) - 3) if lines[i : i + 3] == context]
        assert any(lines[i + 3] == gold for i in starts)
    assert len({d["label"] for d in docs}) > 1  # the answer position varies


def test_bad_document_requests_fail_clearly(text):
    with pytest.raises(ValueError, match="n=0"):
        next_line_documents(text, n=0)
    with pytest.raises(ValueError, match="verse lines"):
        next_line_documents("ACT I\nshort\n", n=4)


def test_eval_sweep_runs_the_task_offline_through_lm_eval(model, monkeypatch):  # noqa: F811
    import popjax.eval.harness as harness

    docs = next_line_documents(load_play(DEV_PLAY), n=4, context_lines=1)
    monkeypatch.setattr(harness, "write_next_line_task", lambda directory, play, n: write_task(directory, docs))
    records = evaluate(model, [popjax.Dense(), popjax.Static(0.3)], ["next_line"], "", EvalSettings())
    assert [r["task"] for r in records] == ["next_line", "next_line"]
    for r in records:  # 4 documents: accuracies are multiples of 1/4
        assert all(0.0 <= r[k] <= 1.0 and (r[k] * 4) % 1 < 1e-9 for k in ("next_line_acc", "next_line_acc_norm"))
