"""Tests do not import each other: a test module (``test_*.py``) is imported by pytest alone, and
what several tests share lives outside them — the references in ``tests/reference/``, fixtures in
a ``conftest.py``, workers and helpers beside their tests (``scale/eight_devices.py``,
``accelerators/targets.py``). ``tests/reference/`` imports no test module and, of the tests
package, only itself and ``tests.conftest``'s helpers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path`` (inside functions too), relative imports
    resolved against its package; ``from pkg import name`` yields ``pkg.name`` as well (a name may
    be a module: ``from tests.models import test_vlm``)."""
    tree = ast.parse(path.read_text() if source is None else source)
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[0] == "tests" and dotted.split(".")[-1].startswith("test_")


def _violations(path: Path, source: str | None = None) -> list[str]:
    found = []
    in_reference = path.relative_to(ROOT).parts[:2] == ("tests", "reference")
    for line, module in _imported_modules(path, source):
        if _is_test_module(module):
            found.append(f"{path.relative_to(ROOT)}:{line} imports the test module {module}")
        elif in_reference and module.split(".")[0] == "tests" and not module.startswith(("tests.reference", "tests.conftest")):
            found.append(f"{path.relative_to(ROOT)}:{line}: tests/reference imports {module} (only tests.reference, tests.conftest)")
    return found


def test_no_test_module_imports_another():
    files = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "tools").glob("*.py")])
    assert len(files) > 50
    found = [v for path in files for v in _violations(path)]
    assert not found, "move what they share into tests/reference/ (or a conftest.py):\n" + "\n".join(found)


def test_the_rule_catches_each_form_of_import():
    path = ROOT / "tests" / "eval" / "test_example.py"
    for source in ("from tests.methods.test_calibration import tiny_corpus", "from .test_lm_eval import converted",
                   "from tests.models import test_vlm as t", "import tests.models.test_parity",
                   "def f():\n    from tests.methods.test_method_matrix import ready"):
        assert _violations(path, source), source
    assert not _violations(path, "from tests.reference.corpus import tiny_corpus\nfrom tests.conftest import TINY_BASE")
    reference = ROOT / "tests" / "reference" / "example.py"
    assert _violations(reference, "from tests.accelerators.targets import config")
    assert not _violations(reference, "from tests.reference.ffn import silu")
