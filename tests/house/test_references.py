"""Every dotted ``popjax.…`` name and every repository path (``models/scan.py``) the code and the
docs cite resolves: a module that moved (e.g. ``popjax.kv_calibration`` ->
``popjax.methods.prefill_only.kv_calibration``) fails here rather than sending a reader to a module
that is gone."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("popjax", "models", "convert", "docs", "tools", "tests")
DOTTED = re.compile(r"(?<![\w.])popjax(?:\.[A-Za-z_]\w*)+")
# a path into the repository's own folders (results/ holds outputs a command writes: not checked)
PATH = re.compile(r"(?<![\w/.-])((?:popjax|models|convert|tests|tools|docs)/[\w/.-]*\w\.(?:py|md|json))\b")
FILE_SUFFIXES = {"json", "md", "py", "toml", "txt", "yaml"}  # "popjax.json" is a file name, not a module


def _resolves(dotted: str) -> bool:
    """Whether ``popjax.a.b.c`` names a module or an attribute reached from one (each part in turn
    an attribute or a submodule)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ImportError:
            return False
    return True


def _cited(pattern: re.Pattern) -> dict[str, set[str]]:
    """What ``pattern`` matches in the sources and docs -> the files citing it."""
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    cited: dict[str, set[str]] = {}
    for path in [*files, ROOT / "README.md"]:
        if path == Path(__file__).resolve():  # its own examples of names that do not resolve
            continue
        for match in pattern.finditer(path.read_text(errors="ignore")):
            name = match.group(1) if pattern.groups else match.group(0)
            if pattern is PATH or name.rsplit(".", 1)[-1] not in FILE_SUFFIXES:
                cited.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return cited


def test_every_cited_popjax_name_resolves():
    cited = _cited(DOTTED)
    assert "popjax.methods.prefill_only.kv_calibration" in cited  # the scan reads the sources
    missing = {name: sorted(files) for name, files in cited.items() if not _resolves(name)}
    assert not missing, f"cited names that do not resolve (moved or renamed?): {missing}"


def test_a_moved_module_would_fail():
    assert not _resolves("popjax.kv_training.fit_optax")
    assert _resolves("popjax.methods.prefill_only.kv_training.fit_optax")


def test_every_cited_repository_path_exists():
    cited = _cited(PATH)
    assert "models/scan.py" in cited  # the scan reads the sources
    missing = {path: sorted(files) for path, files in cited.items() if not (ROOT / path).exists()}
    assert not missing, f"cited paths that do not exist (moved or renamed?): {missing}"
