"""What the packages export stays complete: every registered method is in ``popjax.__all__`` and
``popjax.methods.__all__``, and ``popjax.methods.__all__`` names exactly what that module imports
from its submodules or defines (a method added to the registry but not the exports fails here)."""

from __future__ import annotations

import ast
import inspect

import popjax
import popjax.methods as methods


def _exported_by_source(module) -> set[str]:
    """The public names ``module`` imports relatively (from its own submodules) or defines."""
    tree = ast.parse(inspect.getsource(module))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id.isupper():
            names.add(node.target.id)  # METHODS
    return {n for n in names if not n.startswith("_")}


def test_every_registered_method_is_exported_by_both_packages():
    classes = {cls.__name__ for cls in methods.METHODS.values()}
    assert classes - set(methods.__all__) == set(), "popjax/methods/__init__.py __all__"
    assert classes - set(popjax.__all__) == set(), "popjax/__init__.py __all__"
    for name in classes:
        assert getattr(popjax, name) is getattr(methods, name), name


def test_methods_all_is_what_the_module_imports_and_defines():
    public = _exported_by_source(methods)
    listed = set(methods.__all__)
    assert public - listed == set(), f"imported or defined but not in __all__: {sorted(public - listed)}"
    assert listed - public == set(), f"in __all__ but not in the module: {sorted(listed - public)}"
    assert len(methods.__all__) == len(listed), "a name is listed twice"
    for name in methods.__all__:
        assert hasattr(methods, name), name
