"""Collectives in compiled HLO text: what a sharded program communicates (tests and plans read it)."""

from __future__ import annotations

import re

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops in compiled HLO text (``jit(f).lower(...).compile().as_text()``)."""
    return {op: len(re.findall(rf"= [^=]*? {op}(-start)?\(", hlo_text)) for op in COLLECTIVES}


def collective_operands(hlo_text: str, op: str) -> list[tuple[str, int]]:
    """(shape text, element count) of each ``op`` result in HLO text, largest first."""
    out = []
    for match in re.finditer(rf"= (\(?[a-z0-9]+\[[0-9,]*\][^=]*?) {op}(-start)?\(", hlo_text):
        dims = re.findall(r"\[([0-9,]*)\]", match.group(1))
        size = max((int(np.prod([int(d) for d in s.split(",") if d])) for s in dims), default=0)
        out.append((match.group(1)[:80], size))
    return sorted(out, key=lambda item: -item[1])
