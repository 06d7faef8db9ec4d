"""PIQA (physical commonsense, two solutions per goal) from its own files, scored as
lm-evaluation-harness 0.4 scores its ``piqa`` task.

**Files** (`github:ybisk/ybisk.github.io`, folder ``piqa/data/``, AFL 3.0): ``DIR/piqa/valid.jsonl``
(1,838 lines of ``{"goal", "sol1", "sol2"}``) and ``DIR/piqa/valid-labels.lst`` (one 0/1 per line:
the correct solution). lm-eval's dataset (``baber/piqa``) is the same validation split with the
label joined in; its ``validation`` split is what lm-eval scores.

**Scoring** (lm-eval's ``tasks/piqa/piqa.yaml`` and ``ConfigurableTask.process_results``): the
context is ``"Question: {goal}\\nAnswer:"``, each choice is scored as ``" " + sol`` (the target
delimiter) after it, by the sum of its tokens' log-probabilities. ``acc``: the first argmax is the
label. ``acc_norm``: the first argmax of the log-likelihood divided by ``len(sol)``, the choice's
length in characters without the delimiter (lm-eval's ``completion_len``; its byte-length variant
is ``acc_bytes``, which piqa does not report). ``--limit N`` takes the first N questions, as
lm-eval's does. Zero-shot only: lm-eval's piqa draws shots from the train split, which is not read here.

**The lm-eval route** (`write_lm_eval_task`): lm-eval's own ``piqa.yaml``, included by a local
YAML that only points its dataset at a JSON-lines file of these questions (``dataset_path: json``),
so ``popjax lm-eval`` scores the same documents with lm-eval's own prompt and metrics, offline.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .bigbench import Query

NAME = "piqa"
LM_EVAL_TASK = "piqa_local"  # not "piqa": lm-eval's built-in task of that name reads the dataset hub
SOURCE = "github:ybisk/ybisk.github.io (folder piqa/data/: valid.jsonl, valid-labels.lst)"


def read_documents(root: str | Path) -> list[dict]:
    """``root/piqa/valid.jsonl`` and ``valid-labels.lst`` -> [{"goal", "sol1", "sol2", "label"}]
    in file order. FileNotFoundError saying where to get a missing file; ValueError for files
    that do not pair up."""
    folder = Path(root) / "piqa"
    questions, labels = folder / "valid.jsonl", folder / "valid-labels.lst"
    for path in (questions, labels):
        if not path.is_file():
            raise FileNotFoundError(f"PIQA file {path} does not exist; --data-dir DIR needs DIR/piqa/ from {SOURCE}")
    lines = [line for line in questions.read_text(encoding="utf-8").splitlines() if line.strip()]
    answers = [line.strip() for line in labels.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(lines) != len(answers):
        raise ValueError(f"PIQA: {questions} has {len(lines)} questions but {labels} has {len(answers)} labels; "
                         "they must be the same split's two files")
    docs = []
    for i, (line, answer) in enumerate(zip(lines, answers), 1):
        if answer not in ("0", "1"):
            raise ValueError(f"PIQA: line {i} of {labels} is {answer!r}; a label is 0 (sol1) or 1 (sol2)")
        doc = json.loads(line)
        missing = {"goal", "sol1", "sol2"} - set(doc)
        if missing:
            raise ValueError(f"PIQA: line {i} of {questions} lacks {sorted(missing)}; each line holds goal, sol1, sol2")
        docs.append({"goal": doc["goal"], "sol1": doc["sol1"], "sol2": doc["sol2"], "label": int(answer)})
    return docs


def query(doc: dict) -> Query:
    """One question as lm-eval's piqa asks it (``absolute``: graded on raw log-likelihoods)."""
    scores = tuple(float(i == doc["label"]) for i in range(2))
    return Query(f"Question: {doc['goal']}\nAnswer:", (doc["sol1"], doc["sol2"]), scores, NAME, absolute=True,
                 delimiter=" ", first_argmax=True)


@dataclasses.dataclass(frozen=True)
class PiqaTask:
    """PIQA's validation questions from ``root`` (read once), in the interface
    `bigbench_score.evaluate_task` takes."""

    root: str
    label: str = NAME
    chance: float = 0.5  # two solutions
    preferred_score: str = "acc"

    @classmethod
    def load(cls, root: str | Path) -> "PiqaTask":
        task = cls(str(root))
        task.documents()  # a missing or malformed file fails here, before any model loads
        return task

    def documents(self, limit: int | None = None) -> list[dict]:
        docs = read_documents(self.root)
        return docs if limit is None else docs[:limit]

    def queries(self, shots: int = 0, limit: int | None = None, seed: int = 0) -> list[Query]:
        """The first ``limit`` questions (all by default), as lm-eval's ``--limit`` takes them;
        ``seed`` is unused (nothing is drawn). ValueError for shots."""
        if shots:
            raise ValueError(f"--shots {shots}: PIQA is scored zero-shot here, as lm-eval's piqa by default")
        if limit is not None and limit < 1:
            raise ValueError(f"--limit {limit} must be ≥ 1")
        return [query(d) for d in self.documents(limit)]


def lm_eval_piqa_yaml() -> Path:
    """lm-eval's own task definition of piqa (installed with lm-eval)."""
    import lm_eval  # optional: lm-evaluation-harness (popjax[eval])

    path = Path(lm_eval.__file__).parent / "tasks" / "piqa" / "piqa.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"lm-eval {getattr(lm_eval, '__version__', '?')} has no {path}; PIQA's lm-eval route "
                                "includes that task definition (lm-eval 0.4 has it)")
    return path


def write_lm_eval_task(root: str | Path, directory: str | Path) -> str:
    """Writes ``piqa_local.yaml`` (lm-eval's ``piqa.yaml`` included, its dataset pointed at a local
    file, no train split) and ``piqa_local.jsonl`` (every question of ``root``, in file order)
    into ``directory`` -> the lm-eval task name. lm-eval's ``--limit`` then takes the first N."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{LM_EVAL_TASK}.jsonl"
    tmp = data.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(d) + "\n" for d in read_documents(root)), encoding="utf-8")
    tmp.replace(data)
    (directory / f"{LM_EVAL_TASK}.yaml").write_text("\n".join([
        f"include: {json.dumps(str(lm_eval_piqa_yaml()))}",
        f"task: {LM_EVAL_TASK}",
        "dataset_path: json",
        "dataset_name: null",
        f"dataset_kwargs:\n  data_files:\n    validation: {json.dumps(str(data.resolve()))}",
        "training_split: null  # only the validation file is read; zero-shot needs no other split",
        "",
    ]), encoding="utf-8")
    return LM_EVAL_TASK
