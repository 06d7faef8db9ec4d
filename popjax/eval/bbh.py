"""BIG-Bench Hard's fixed-answer tasks as BIG-bench multiple choice (`popjax.eval.bigbench`).

**Files** (`github:suzgunmirac/BIG-Bench-Hard`, MIT): ``DIR/bbh/NAME.json`` holds
``{"examples": [{"input", "target"}, ...]}`` and ``DIR/cot-prompts/NAME.txt`` the task's three
chain-of-thought exemplars; a checkout of that repository is a valid ``DIR``. The files are read
where they are and turned into a `bigbench.Task` in memory (family ``"bbh"``), rather than
converted into BIG-bench task folders: one copy of the data, and the answer sets below live in
code, tested, instead of in generated files.

**Answer sets.** A task is multiple choice when its answers are fixed:
- lettered options: every target is ``(A)``…``(R)``; an example's choices are the option letters
  its input lists (``(A) 12/11/1937`` …). Three examples of the repository's files list a title
  with a comma split into two options and give the title as the target (movie_recommendation: 1,
  ruin_names: 2); no option matches, so they are skipped with a warning, as is one snarks example
  whose input is cut off after its first option.
- two answers: the task's two distinct targets (True/False, Yes/No, yes/no, valid/invalid).
The other four tasks (dyck_languages, multistep_arithmetic_two, object_counting, word_sorting) have
free-form answers and are refused. That leaves 23 of the 27 tasks.

**Prompts** are BBH's own answer-only format (and lm-eval's ``bbh_fewshot``): ``"Q: {input}\\nA: "``
then the choice. With ``fewshot``, the task's description and its three exemplars from
``cot-prompts/`` come first, each exemplar cut to its answer: the chain of thought is dropped and
``So the answer is X.`` becomes ``A: X``, the exemplars separated by a blank line, as BBH's
answer-only prompts are.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from .bigbench import NoMultipleChoice, Task

log = logging.getLogger(__name__)

PREFIX = "bbh:"
SOURCE = "github:suzgunmirac/BIG-Bench-Hard"
FREE_FORM = ("dyck_languages", "multistep_arithmetic_two", "object_counting", "word_sorting")
_LETTER = re.compile(r"^\([A-R]\)$")
_OPTION = re.compile(r"^(\([A-R]\)) ", re.MULTILINE)
_ANSWER = re.compile(r"So the answer is (.+?)\.?\s*$", re.DOTALL)
# BBH's answer-only layout: BIG-bench's query pieces, so `build_queries` builds the prompt
FORMAT = {"example_input_prefix": "Q: ", "example_output_prefix": "\nA: ", "append_choices_to_input": False,
          "few_shot_example_separator": "\n\n"}


def task_file(root: str | Path, name: str) -> Path:
    """``root/bbh/name.json``; FileNotFoundError saying where the files come from, or naming the
    close task names when the folder exists."""
    path = Path(root) / "bbh" / f"{name}.json"
    if path.is_file():
        return path
    if not (Path(root) / "bbh").is_dir():
        raise FileNotFoundError(f"BBH task {name!r}: {path} does not exist; --data-dir DIR needs DIR/bbh/NAME.json "
                                f"from {SOURCE} (folder bbh/)")
    known = ", ".join(fixed_answer_tasks(root)) or "none"
    raise FileNotFoundError(f"unknown BBH task {name!r} ({path} does not exist); fixed-answer tasks there: {known}")


def fixed_answer_tasks(root: str | Path) -> list[str]:
    """The names of ``root/bbh/*.json`` that have fixed answers (not `FREE_FORM`), sorted."""
    return sorted(p.stem for p in (Path(root) / "bbh").glob("*.json") if p.stem not in FREE_FORM)


def answer_set(examples: list[dict], name: str) -> tuple[str, list[str] | None]:
    """-> ("letters", None) when the targets are option letters, ("fixed", the two answers) when
    the task has two; NoMultipleChoice for a free-form task."""
    targets = [str(e["target"]) for e in examples]
    letters = sum(bool(_LETTER.match(t)) for t in targets)
    if letters >= 0.95 * len(targets):  # a few broken examples do not make the task free-form
        return "letters", None
    distinct = sorted(set(targets))
    if len(distinct) == 2:
        return "fixed", distinct
    raise NoMultipleChoice(f"BBH task {name!r} has free-form answers ({len(distinct)} distinct targets), not a fixed "
                           "answer set; it cannot be scored as multiple choice", "exact_str_match")


def _mc_examples(examples: list[dict], name: str) -> list[dict]:
    kind, fixed = answer_set(examples, name)
    out, skipped = [], 0
    for e in examples:
        choices = _OPTION.findall(e["input"]) if kind == "letters" else fixed
        if e["target"] not in choices or len(choices) < 2:
            skipped += 1
            continue
        out.append({"input": e["input"], "target": e["target"], "target_scores": {c: int(c == e["target"]) for c in choices}})
    if skipped:
        log.warning("BBH %s: %d examples skipped: the target is none of their options, or they list fewer than two", name, skipped)
    return out


def answer_only_prompt(text: str, name: str) -> str:
    """A cot-prompts file -> BBH's answer-only few-shot prefix: the description, then each
    exemplar as ``Q: ...\\nA: X``, a blank line after each. ValueError when an exemplar has no
    ``So the answer is X``."""
    body = text.split("-----", 1)[-1].strip()  # the canary line and its rule come first
    description, *blocks = re.split(r"\n\n(?=Q: )", body)
    shots = []
    for block in blocks:
        question, sep, reasoning = block.partition("\nA: ")
        answer = _ANSWER.search(reasoning)
        if not sep or answer is None:
            raise ValueError(f"BBH prompt {name!r}: an exemplar without 'A: ... So the answer is X.': {block[:80]!r}")
        shots.append(f"{question}\nA: {answer.group(1).strip()}")
    if not shots:
        raise ValueError(f"BBH prompt {name!r} has no 'Q: ' exemplars")
    return description.strip() + "\n\n" + "".join(s + "\n\n" for s in shots)


def load_task(name: str, root: str | Path, fewshot: bool = False) -> Task:
    """The BBH task ``name`` (``bbh:`` optional) from ``root/bbh/name.json`` as a `Task` of family
    ``"bbh"``; with ``fewshot``, its answer-only three-shot prefix from ``root/cot-prompts/name.txt``
    (the task's name gains ``-3shot``, so records of both settings stay apart)."""
    name = name.removeprefix(PREFIX)
    path = task_file(root, name)
    examples = json.loads(path.read_text(encoding="utf-8"))["examples"]
    data = dict(FORMAT, name=name, preferred_score="multiple_choice_grade")
    if fewshot:
        prompt = Path(root) / "cot-prompts" / f"{name}.txt"
        if not prompt.is_file():
            raise FileNotFoundError(f"BBH few-shot prompt {prompt} does not exist; it comes from {SOURCE} (folder cot-prompts/)")
        data["task_prefix"] = answer_only_prompt(prompt.read_text(encoding="utf-8"), name)
    label = f"{name}-3shot" if fewshot else name
    return Task(label, "multiple_choice_grade", ((label, data, tuple(_mc_examples(examples, name))),), family="bbh")
