"""docs/architecture.md stays the code's map: its layer diagram holds the import-linter layers of
pyproject.toml, top to bottom, and its ``popjax.cli`` entry names every command and their count."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

from popjax.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "architecture.md").read_text()


def _diagram() -> str:
    """The page's first fenced block: the layer diagram."""
    return re.search(r"```\n(popjax\.cli.*?)```", PAGE, re.S).group(1)


def test_the_diagram_lists_the_contracts_layers_in_order():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = [sorted(m.strip() for m in layer.split("|")) for layer in contract["layers"]]
    drawn = []
    for line in _diagram().splitlines():  # a layer's line starts with its modules at column 0
        if line.startswith("popjax."):
            modules = re.findall(r"popjax\.(\w+)", line.split("  ")[0] if " | " not in line else line)
            drawn.append(sorted(modules))
    assert drawn == layers, f"docs/architecture.md's diagram {drawn} != pyproject.toml's layers {layers}"


def test_the_cli_entry_names_every_command():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = list(sub.choices)
    entry = _diagram().split("popjax.bench")[0]  # the popjax.cli line and its continuation
    words = " ".join(line.strip(" │") for line in entry.splitlines())
    missing = [c for c in commands if not re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", words)]
    assert not missing, f"docs/architecture.md's popjax.cli entry leaves out {missing}"
    assert f"({len(commands)}:" in words, f"the entry should count {len(commands)} commands"
