"""BIG-bench's JSON multiple-choice tasks: the task files, prompts built as BIG-bench builds them,
and its metrics (scoring with the engine: `popjax.eval.bigbench_score`).

**Files.** ``bigbench==1.0.0`` on PyPI ships ``bigbench/benchmark_tasks/<task>/task.json`` (and
``<task>/<subtask>/task.json``); the sdist is fetched once into popjax's cache and only those
files are streamed out of it into an entry of their own (`convert.pypi.streamed_members`; the
unpacked tree is 1.7 GB). A local directory of task folders in the same layout, or a task.json
path, works the same way.

**Prompts** (BIG-bench's ``bigbench/api/json_task.py``: ``default_format_fn``,
``make_nshot_dataset``, ``JsonTask.evaluate_fixed_shot``)::

    query  = example_input_prefix + input                                   (default "\\nQ: ")
             [+ choice_prefix + choice_prefix.join(permuted choices)]        (append_choices_to_input,
                                                                              default true, "\\n  choice: ")
             + example_output_prefix                                         (default "\\nA: ")
    prompt = task_prefix + [shot_1 + sep + ... + shot_k + sep] + query       (few_shot_example_separator, "\\n")
    shot   = another example's query + one of its targets

The appended choices are ``np.random.RandomState(42).permutation(sorted(choices))``, a fresh
generator per example, as BIG-bench seeds it. Shots and ``limit`` follow ``make_nshot_dataset``
with one ``RandomState(seed)`` per task: ``limit`` queries drawn without replacement (all, in file
order, without a limit at 0 shots), then per query ``k`` other examples and one target of each.

**Scores.** Each choice's absolute log-probability after the prompt; ``multiple_choice_grade`` is
the target score of the argmax choice (ties broken by a hash of the score vector, BIG-bench's
``task_metrics.argmax``); chance is BIG-bench's ``low_score``: the mean over examples of the mean
target score. A task with subtasks is their examples pooled, each with its subtask's prefixes
(BIG-bench weights subtask scores by their example counts, which is the same mean);
``parent/subtask`` names one subtask.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..cache import get_or_make
from ..convert.pypi import streamed_members
from .paired import wilson_interval  # noqa: F401  (re-exported: the metrics of this module's records)

log = logging.getLogger(__name__)

SPEC, SDIST = "bigbench==1.0.0", "bigbench-1.0.0.tar.gz"
TASKS_PREFIX = "bigbench-1.0.0/bigbench/benchmark_tasks/"
PREFIX = "bigbench:"  # the task-name grammar of `popjax eval --tasks`
PERMUTATION_SEED = 42  # default_format_fn's generator
DEFAULT_SEED = 42  # JsonTask's random_seed: shots and the limit's draw


@dataclasses.dataclass(frozen=True)
class Query:
    """One multiple-choice question as the model sees it: ``prompt`` (the whole text before a
    choice), the ``choices`` in the task file's order and their ``scores`` (target_scores)."""

    prompt: str
    choices: tuple[str, ...]
    scores: tuple[float, ...]
    subtask: str
    absolute: bool = False  # the task's absolute_normalization: grade on unnormalised log-probs
    # lm-eval's target_delimiter: scored between the prompt and each choice, but not part of the
    # choice's length in acc_norm (lm-eval divides by len(choice) without it)
    delimiter: str = ""
    # lm-eval's acc: the first maximum of the log-likelihoods (BIG-bench breaks ties by a hash)
    first_argmax: bool = False

    @property
    def texts(self) -> tuple[str, ...]:
        """What follows the prompt for each choice: the delimiter, then the choice."""
        return tuple(self.delimiter + c for c in self.choices)


@dataclasses.dataclass(frozen=True)
class Task:
    """A BIG-bench task reduced to its multiple-choice examples, per (sub)task with its own
    prefixes: ``parts`` is ((subtask name, task.json dict, MC examples), ...)."""

    name: str
    preferred_score: str
    parts: tuple[tuple[str, dict, tuple[dict, ...]], ...]
    family: str = "bigbench"  # where the files come from: "bigbench", or "bbh" (popjax.eval.bbh)

    @property
    def label(self) -> str:
        """The task's name in records and on the command line: ``family:name``."""
        return f"{self.family}:{self.name}"

    def queries(self, shots: int = 0, limit: int | None = None, seed: int = DEFAULT_SEED) -> list["Query"]:
        """`build_queries` of this task."""
        return build_queries(self, shots, limit, seed)

    @property
    def examples(self) -> int:
        return sum(len(examples) for _, _, examples in self.parts)

    @property
    def chance(self) -> float:
        """BIG-bench's random baseline: the mean over examples of the mean target score."""
        means = [np.mean(list(e["target_scores"].values())) for _, _, ex in self.parts for e in ex]
        return float(np.mean(means))

    def max_shots(self) -> int:
        """The most shots every part allows (BIG-bench needs shots + 1 distinct examples)."""
        return min(len(examples) for _, _, examples in self.parts) - 1


# ---------------------------------------------------------------- files


def default_root() -> Path:
    """The task folders of the cached sdist (fetched and streamed out once); FileNotFoundError
    with pip's last line when the sdist cannot be downloaded."""
    try:
        return streamed_members(SPEC, SDIST, TASKS_PREFIX + "*task.json", TASKS_PREFIX)
    except RuntimeError as err:  # pip's failure: its stderr's last line says why
        why = [line for line in str(err).splitlines() if line.strip()][-1]
        raise FileNotFoundError(f"BIG-bench's task files come from {SPEC} on PyPI, which could not be downloaded "
                                f"({why.strip()}); pass a folder of <task>/task.json with --bigbench-dir") from err


def task_index(root: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """name -> {"examples": multiple-choice examples, "preferred_score", "subtasks": [...]} for
    every task folder under ``root`` (default: the cached sdist's; its index is cached too, so
    the ~90 files are parsed once). Tasks without multiple-choice examples are listed with 0."""
    if root is not None:
        return _build_index(Path(root))
    tasks = default_root()

    def make(directory: Path) -> None:
        (directory / "index.json").write_text(json.dumps(_build_index(tasks), indent=1, sort_keys=True))

    entry = get_or_make("data", {"bigbench_index": SPEC, "format": 1}, make, name="bigbench-index")
    return json.loads((entry / "index.json").read_text())


def _build_index(root: Path) -> dict[str, dict[str, Any]]:
    if not root.is_dir():
        raise FileNotFoundError(f"BIG-bench task directory {root} does not exist")
    index = {}
    for path in sorted(root.glob("*/task.json")):
        try:
            task = _task_from_folder(path.parent.name, path.parent)
            index[task.name] = {"examples": task.examples, "preferred_score": task.preferred_score,
                                "subtasks": [name for name, _, _ in task.parts if name != task.name]}
        except NoMultipleChoice as err:
            index[path.parent.name] = {"examples": 0, "preferred_score": err.preferred_score, "subtasks": []}
    return index


def list_tasks(root: str | Path | None = None) -> list[str]:
    """Names of the tasks that have multiple-choice examples (``target_scores``)."""
    return sorted(name for name, info in task_index(root).items() if info["examples"] > 0)


class NoMultipleChoice(ValueError):
    def __init__(self, message: str, preferred_score: str = ""):
        super().__init__(message)
        self.preferred_score = preferred_score


def load_task(name: str, root: str | Path | None = None) -> Task:
    """The task ``name`` (``social_iqa``, ``parent/subtask``, with or without the ``bigbench:``
    prefix) from ``root`` (default: the cached sdist), or a task.json path / task folder.
    ValueError with close names for an unknown task; `NoMultipleChoice` for one without
    multiple-choice examples."""
    name = name.removeprefix(PREFIX)
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        return _task_from_folder(path.parent.name, path.parent, path)
    if path.is_dir() and (path / "task.json").is_file():
        return _task_from_folder(path.name, path)
    base = Path(root) if root is not None else default_root()
    parent, _, sub = name.partition("/")
    folder = base / parent
    if not parent or not (folder / "task.json").is_file():
        known = sorted(task_index(root)) if root is not None or base.is_dir() else []
        close = difflib.get_close_matches(parent, known, n=5, cutoff=0.5)
        hint = f"; close names: {', '.join(close)}" if close else "; `popjax eval --list-bigbench` lists them"
        raise ValueError(f"unknown BIG-bench task {name!r}{hint}")
    task = _task_from_folder(parent, folder)
    if not sub:
        return task
    parts = [p for p in task.parts if p[0] == f"{parent}/{sub}"]
    if not parts:
        names = [p[0] for p in task.parts]
        close = difflib.get_close_matches(f"{parent}/{sub}", names, n=5, cutoff=0.5)
        raise ValueError(f"unknown subtask {name!r} of BIG-bench task {parent!r}; its subtasks: {', '.join(close or names)}")
    return Task(f"{parent}/{sub}", task.preferred_score, tuple(parts))


def _task_from_folder(name: str, folder: Path, path: Path | None = None) -> Task:
    data = json.loads((path or folder / "task.json").read_text(encoding="utf-8"))
    preferred = str(data.get("preferred_score", ""))
    if "examples" in data:
        parts = [(name, data)]
    else:  # a container task: BIG-bench reads every subfolder's task.json, in sorted order
        subs = sorted(folder.glob("*/task.json"))
        if not subs:
            raise ValueError(f"BIG-bench task {name!r} ({folder}) has neither examples nor subtask folders")
        parts = [(f"{name}/{p.parent.name}", json.loads(p.read_text(encoding="utf-8"))) for p in subs]
        preferred = preferred or str(parts[0][1].get("preferred_score", ""))
    kept = tuple((sub, d, examples) for sub, d in parts if (examples := _mc_examples(sub, d)))
    if not kept:
        raise NoMultipleChoice(f"BIG-bench task {name!r} has no multiple-choice examples (target_scores); "
                               f"its preferred score is {preferred or 'not stated'}", preferred)
    return Task(name, preferred, kept)


def _mc_examples(name: str, data: dict) -> tuple[dict, ...]:
    """The distinct examples with target_scores (BIG-bench drops duplicates, keeping order) whose
    best score beats their worst (BIG-bench refuses an example without a correct choice)."""
    seen, out, dropped = set(), [], 0
    for example in data.get("examples", []):
        key = json.dumps(example)
        if key in seen or "target_scores" not in example:
            continue
        seen.add(key)
        scores = list(example["target_scores"].values())
        if len(scores) < 2 or max(scores) <= min(scores):
            dropped += 1
            continue
        out.append(example)
    if dropped:
        log.warning("BIG-bench %s: %d examples without a correct choice skipped", name, dropped)
    return tuple(out)


# ---------------------------------------------------------------- prompts


def format_example(data: dict, example: dict) -> tuple[str, list[str]]:
    """BIG-bench's ``default_format_fn`` for one multiple-choice example -> (the query text,
    its targets: ``target`` if given, else the first choice with the best score)."""
    choices = list(example["target_scores"])
    text = example["input"]
    if data.get("append_choices_to_input", True):
        prefix = data.get("choice_prefix", "\n  choice: ")
        permuted = np.random.RandomState(seed=PERMUTATION_SEED).permutation(sorted(choices))
        text = text + prefix + prefix.join(permuted)
    targets = example.get("target")
    if targets is None:
        best = max(example["target_scores"].values())
        targets = [next(k for k, v in example["target_scores"].items() if v == best)]
    targets = targets if isinstance(targets, list) else [targets]
    text = data.get("example_input_prefix", "\nQ: ") + text + data.get("example_output_prefix", "\nA: ")
    return text, targets


def build_queries(task: Task, shots: int = 0, limit: int | None = None, seed: int = DEFAULT_SEED) -> list[Query]:
    """The task's queries (BIG-bench's ``make_nshot_dataset`` per part; ``limit`` spread over the
    parts as BIG-bench spreads ``max_examples``: ``limit // parts`` each). ValueError for
    ``shots`` beyond what the task allows or a ``limit`` below the number of parts."""
    if shots < 0 or (limit is not None and limit < 1):
        raise ValueError(f"shots={shots} must be ≥ 0 and limit={limit} ≥ 1")
    if shots > task.max_shots():
        raise ValueError(f"--shots {shots} is more than BIG-bench task {task.name!r} allows: at most "
                         f"{task.max_shots()} (each shot is another of its multiple-choice examples)")
    per_part = None
    if limit is not None:
        per_part = limit // len(task.parts) if len(task.parts) > 1 else limit
        if per_part < 1:
            raise ValueError(f"--limit {limit} is below the {len(task.parts)} subtasks of {task.name!r}")
    queries = []
    for sub, data, examples in task.parts:
        formatted = [format_example(data, e) for e in examples]
        rng = np.random.RandomState(seed=seed)
        order = list(range(len(examples)))
        if per_part is not None and (shots > 0 or per_part < len(order)):
            order = rng.choice(len(order), min(per_part, len(order)), replace=False).tolist()
        separator = data.get("few_shot_example_separator", "\n")
        for i in order:
            text = formatted[i][0]
            if shots:
                others = [j for j in range(len(formatted)) if j != i]
                context = [formatted[others[j]] for j in rng.choice(len(others), shots, replace=False)]
                text = separator.join(q + str(rng.choice(targets)) for q, targets in context) + separator + text
            scores = examples[i]["target_scores"]
            queries.append(Query(str(data.get("task_prefix", "")) + text, tuple(scores), tuple(map(float, scores.values())), sub,
                                 bool(data.get("absolute_normalization", False))))
    return queries


# ---------------------------------------------------------------- metrics


def bigbench_argmax(scores: np.ndarray) -> int:
    """BIG-bench's ``task_metrics.argmax``: the maximum, ties broken by the sha256 of the
    (float64) score vector."""
    scores = np.asarray(scores, np.float64)
    best = np.flatnonzero(scores == scores.max())
    return int(best[int(hashlib.sha256(scores.tobytes()).hexdigest(), 16) % len(best)])


def normalized(logprobs: np.ndarray) -> np.ndarray:
    """Log-probabilities renormalised over the choices (BIG-bench's ``log_prob`` unless a task
    sets ``absolute_normalization``); the argmax is the same, the tie-break hash is not."""
    logprobs = np.asarray(logprobs, np.float64)
    top = logprobs.max()
    return logprobs - (top + np.log(np.exp(logprobs - top).sum()))


def grade(query: Query, logprobs: np.ndarray) -> float:
    """``multiple_choice_grade`` of one query: the target score of the chosen choice (lm-eval's
    ``acc`` for a ``first_argmax`` query: 1 when its first maximum is a best-scored choice)."""
    if query.first_argmax:  # lm-eval's acc
        return float(query.scores[int(np.argmax(np.asarray(logprobs, np.float64)))] == max(query.scores))
    chosen = bigbench_argmax(np.asarray(logprobs, np.float64) if query.absolute else normalized(logprobs))
    return query.scores[chosen]


def norm_correct(query: Query, logprobs: np.ndarray) -> float:
    """lm-eval's ``acc_norm``: the argmax (first) of log-probability per character of the choice
    (without the delimiter, as lm-eval counts ``len(choice)``) is a best-scored choice."""
    lengths = np.array([max(len(c), 1) for c in query.choices], np.float64)
    return float(query.scores[int(np.argmax(np.asarray(logprobs, np.float64) / lengths))] == max(query.scores))
