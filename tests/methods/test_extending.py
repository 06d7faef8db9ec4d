"""docs/extending.md's method recipe is verified: the page's own code block (read from the page,
not copied) defines a method that registers, binds and generates on the tiny model."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import popjax
from popjax.methods import METHODS, MethodError, parse_method_spec

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
MARKER = "<!-- the block below is executed by tests/methods/test_extending.py -->"
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9], [8, 9, 10, 100, 101]]


def _recipe(monkeypatch) -> dict:
    """Runs the page's marked code block -> its namespace; the registry entry it adds is removed
    after the test (monkeypatch restores METHODS)."""
    text = PAGE.read_text()
    assert MARKER in text, f"{PAGE} lost the marker of its executed method example"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    assert block, "no python block after the marker"
    monkeypatch.setitem(METHODS, "random-subset", None)  # restored (removed) at teardown
    module = types.ModuleType("extending_recipe")  # a real module: dataclasses look their class's module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    # dont_inherit: the block runs as the page reads, without this file's __future__ annotations
    exec(compile(block.group(1), str(PAGE), "exec", dont_inherit=True), module.__dict__)  # noqa: S102
    return module.__dict__


def test_the_documented_method_registers_and_generates(monkeypatch, tiny_model):
    ns = _recipe(monkeypatch)
    cls, plan_cls = ns["RandomSubset"], ns["RandomSubsetPlan"]
    assert METHODS["random-subset"] is cls
    method = parse_method_spec("random-subset:ratio=0.3:seed=1")
    assert method == cls(ratio=0.3, seed=1)
    plan = method.bind(tiny_model.config)
    assert isinstance(plan, plan_cls) and plan.n_keep < plan.f
    ids, _ = popjax.generate_ids(tiny_model, PROMPTS, max_new_tokens=5, method="random-subset", stop_ids=[])
    assert [len(row) for row in ids] == [5, 5]
    # at ratio 0 it is the dense model, token for token; pruned it runs its own plan (other logits)
    dense, _ = popjax.generate_ids(tiny_model, PROMPTS, max_new_tokens=5, stop_ids=[])
    assert popjax.generate_ids(tiny_model, PROMPTS, max_new_tokens=5, method=cls(ratio=0.0), stop_ids=[])[0] == dense
    tokens = np.asarray([PROMPTS[0]])
    full = np.asarray(popjax.forward(tiny_model, tokens))
    pruned = np.asarray(popjax.forward(tiny_model, tokens, method=cls(ratio=0.3)))
    assert np.abs(full - pruned).max() > 1e-3


def test_the_documented_method_refuses_bad_values_in_one_line(monkeypatch):
    cls = _recipe(monkeypatch)["RandomSubset"]
    with pytest.raises(MethodError, match=r"ratio=1\.5 is outside \[0, 1\)"):
        cls(ratio=1.5)
    with pytest.raises(MethodError, match=r"seed=-1 must be a non-negative integer"):
        cls(seed=-1)
