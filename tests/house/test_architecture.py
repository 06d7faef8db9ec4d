"""The package's architecture rules (docs/architecture.md), checked on the source tree.

* the layer contract in pyproject.toml holds (import-linter: no upward import, no cycle);
* popjax's own modules are imported at the top of a module, never inside a function (an
  import inside a function is for an optional heavy dependency, with a comment saying so);
* no module of the package imports the package root ``popjax``;
* the model (``models/``) names no pruning method;
* the project points no reader to a document outside it;
* no Python file of the project (package, tests, tools, benchmarks) is over 400 lines.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import popjax

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("popjax", "models", "convert")


def package_files() -> list[Path]:
    return sorted(p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py"))


def test_the_layer_contract_holds():
    """`python tools/lint_imports.py` (import-linter on the package as installed) keeps every contract."""
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "lint_imports.py")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"Contracts: (\d+) kept, 0 broken", result.stdout), result.stdout[-2000:]


def _is_own_module(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "popjax"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "popjax" for a in node.names)


def function_imports(path: Path) -> list[tuple[int, ast.AST]]:
    """(line, node) of every import statement inside a function body of ``path``."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.append((node.lineno, node))
    return sorted(set(found), key=lambda t: t[0])


def test_own_modules_are_imported_at_the_top():
    inside = [f"{p.relative_to(ROOT)}:{line}" for p in package_files() for line, node in function_imports(p) if _is_own_module(node)]
    assert inside == [], f"imports of popjax's own modules inside functions (move them to the top): {inside}"


def test_every_import_inside_a_function_says_why():
    """Each remaining in-function import (an optional heavy dependency) has a comment on its line
    or the line above."""
    silent = []
    for path in package_files():
        lines = path.read_text().splitlines()
        for line, _ in function_imports(path):
            here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                silent.append(f"{path.relative_to(ROOT)}:{line}: {here.strip()}")
    assert silent == [], "in-function imports without a reason:\n" + "\n".join(silent)


def test_no_module_imports_the_package_root():
    offenders = []
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "popjax" for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "popjax":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], f"modules importing the package root (import the module you need instead): {offenders}"


def method_names() -> set[str]:
    """Every registered method's class name and registry name (the dense method excepted: it is
    the absence of pruning, which the model may well mention)."""
    names = set()
    for name, cls in popjax.METHODS.items():
        if cls is not popjax.Dense:
            names |= {name, cls.__name__}
    return names


def test_the_model_names_no_method():
    names = method_names()
    assert {"pop", "POP", "prefill-only", "PrefillOnly", "TEAL"} <= names
    found = []
    for path in sorted((ROOT / "models").rglob("*.py")):
        text = path.read_text()
        for name in sorted(names):
            # lower-case registry names are common words in prose ("static shapes", "dynamic"):
            # match them only where they name a method (quoted, or as a module path)
            pattern = rf"\b{re.escape(name)}\b" if name[0].isupper() or "-" in name or "_" in name else rf"[\"'.]{re.escape(name)}[\"']"
            for m in re.finditer(pattern, text):
                found.append(f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {name}")
        for word in ("popjax.methods", "kv_calibration", "Prefill-Only", "pruning method"):
            if word in text:
                found.append(f"{path.relative_to(ROOT)}: {word}")
    assert found == [], "the model names pruning methods:\n" + "\n".join(found)


MAX_LINES = 400


def test_every_python_file_is_at_most_400_lines():
    """A file a reader can hold: a longer one is split along a seam (its own module), not trimmed."""
    files = [p for d in (*PACKAGE_DIRS, "tests", "tools", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    assert len(lengths) > 100, f"found only {len(lengths)} Python files under {ROOT}"
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}


@pytest.mark.parametrize("pattern", [r"\bSPEC\b ?§", r"\.\./shared", r"\bshared/(SPEC|DESIGN)"])
def test_the_project_points_to_no_outside_document(pattern):
    places = [ROOT / "README.md", *(ROOT / d for d in ("docs", "notebooks", "tools", "tests", *PACKAGE_DIRS))]
    hits = []
    for place in places:
        for path in [place] if place.is_file() else sorted(place.rglob("*")):
            if path.suffix in (".py", ".md", ".ipynb", ".toml") and path != Path(__file__).resolve():
                for i, line in enumerate(path.read_text().splitlines(), 1):
                    if re.search(pattern, line):
                        hits.append(f"{path.relative_to(ROOT)}:{i}")
    assert hits == [], f"references to documents outside the project ({pattern}): {hits}"
