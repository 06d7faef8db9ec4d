"""Optimized HLO text as data: a module's computations, their instructions, and each
instruction's result leaves with their memory spaces (an array layout's ``S(n)``: none (0) is
HBM, 1 VMEM, 2 and above the scalar and semaphore memories). What `hbm_traffic` walks.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

_ITEM_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
               "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([^\s(]+) \(")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([^\s=]+) = (.*)$")

@dataclasses.dataclass(frozen=True)
class Array:
    """One array leaf of an instruction's type: element type, dims, memory space (0 = HBM)."""

    dtype: str
    dims: tuple[int, ...]
    space: int

    @property
    def bytes(self) -> float:
        n = 1
        for d in self.dims:
            n *= d
        return n * _ITEM_BYTES.get(self.dtype, 1 if self.dtype.startswith("f8") else 0)

    @property
    def in_hbm(self) -> bool:
        return self.space == 0


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    leaves: list[Array]
    operands: list[str]
    attrs: str
    root: bool


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.root)

    def parameter(self, index: int) -> Instruction:
        return next(i for i in self.instructions.values() if i.opcode == "parameter" and i.attrs.startswith(f"{index})"))

    def users(self, name: str) -> Iterator[Instruction]:
        return (i for i in self.instructions.values() if name in i.operands)


def _leaves(type_text: str) -> list[Array]:
    out = []
    for dtype, dims, layout in _ARRAY.findall(type_text):
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
    return out


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis group that opens at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in HLO: {text[start:start + 80]!r}")


def _instruction(line: str) -> Instruction | None:
    m = _INSTRUCTION.match(line)
    if m is None:
        return None
    root, name, rest = m.groups()
    end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([a-z][a-z0-9-]*)\(", rest)
    if op is None:
        return None
    close = _balanced(rest, op.end() - 1)
    operand_text = rest[op.end():close - 1]
    attrs = rest[close:].lstrip(", ")
    if op.group(1) in ("parameter", "constant"):
        attrs = operand_text + ")" + attrs  # "N)…": the parameter's index, the constant's literal first
    return Instruction(name, op.group(1), _leaves(type_text), re.findall(r"%([^\s,()]+)", operand_text), attrs,
                       root is not None)


def _statements(text: str) -> Iterator[str]:
    """The module's lines, an instruction whose backend config spans several lines (a Pallas
    call's pretty-printed JSON) joined into one: a line continues while its brackets are open."""
    pending, depth = "", 0
    for line in text.splitlines():
        if not pending and (_HEADER.match(line) or line.startswith("}")):
            yield line
            continue
        pending = f"{pending} {line.strip()}" if pending else line
        depth += _depth_change(line)
        if depth <= 0:
            yield pending
            pending, depth = "", 0
    if pending:
        yield pending


def _depth_change(line: str) -> int:
    """Opened minus closed brackets of ``line``, outside string literals."""
    change, quoted, escaped = 0, False, False
    for ch in line:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif not quoted:
            change += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
    return change


def parse_module(text: str) -> tuple[dict[str, Computation], str]:
    """An optimized HLO module's computations by name, and the entry computation's name."""
    computations: dict[str, Computation] = {}
    entry, current = None, None
    for line in _statements(text):
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = Computation(header.group(2), {})
            computations[current.name] = current
            if header.group(1):
                entry = current.name
        elif line.startswith("}"):
            current = None
        elif current is not None:
            ins = _instruction(line)
            if ins is not None:
                current.instructions[ins.name] = ins
    if entry is None:
        raise ValueError("the HLO text holds no ENTRY computation")
    return computations, entry


def called(attrs: str, key: str) -> list[str]:
    """The computations an instruction's attribute ``key`` names (``calls=``, ``body=``, …)."""
    m = re.search(key + r"=\{?([^}]*?)\}?(?:, [a-z_]+=|$)", attrs)
    return re.findall(r"%([^\s,{}]+)", m.group(1)) if m else []
