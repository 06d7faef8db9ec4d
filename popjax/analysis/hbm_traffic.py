"""The HBM traffic of a compiled TPU program, counted from its optimized HLO.

XLA:TPU's cost analysis ("bytes accessed") counts every byte an instruction reads or writes in
any memory: a weight it stages into VMEM before a matrix-vector product is counted when the copy
reads it from HBM, again when the copy writes it to VMEM, and again when the dot reads it there
(docs/tpu.md: a decode step's "bytes accessed" is 1.5-2x its weights). The optimized HLO says
where every buffer lives: a layout's ``S(n)`` is its memory space, none (0) being HBM, 1 VMEM,
2 and above the scalar and semaphore memories (`hlo_text` parses it). ``hbm_traffic(hlo_text)``
walks the program's schedule and counts only what crosses HBM:

* a fusion reads the HBM operands it uses (a parameter the fused code only slices or gathers
  from counts the pieces it takes, one updated in place counts nothing, one a nested fusion only
  bitcasts is followed to that fusion's users: a convolution's weight at batch > 1) and writes its HBM
  results (an in-place update writes only the update);
* an asynchronous copy or slice (``copy-start``, ``slice-start``: XLA:TPU's staging into VMEM)
  counts its HBM side once;
* a Pallas kernel (``tpu_custom_call``) counts the bytes its cost estimate declares (popjax's
  kernels declare their own DMAs and BlockSpecs, `popjax.kernels.traffic`), else its operands
  and results;
* a loop body counts once per trip: a counted loop's (``i < N``: a scan over layers) N trips;
  another's (the decode attention's, over the cache's filled blocks: known only at run time) the
  trips that read the largest loop-carried HBM buffer its body slices in blocks (the cache; at
  a scanned model's layer, that layer's) up to ``filled`` of its rows (the slots written at the
  step counted; None: the whole buffer), else ``loop_trips``; a conditional counts its costliest
  branch.

The count is an **estimate** read from the compiler's output, not a measurement: it ignores
tile padding, assumes a fusion reads each HBM operand it uses once, and knows nothing of
caches; it is what a step would move were it bound by HBM alone.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from .hlo_text import Array, Computation, Instruction, called, parse_module

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "domain"}
_SLICING = {"slice", "dynamic-slice", "gather"}
# custom calls that move no data: an allocation, a concatenation by buffer placement, an assertion on indices
_FREE_CALLS = ("AllocateBuffer", "ConcatBitcast", "AssumeGatherIndicesInBound")


def _declared_bytes(attrs: str) -> float | None:
    """A Pallas kernel's declared ``bytes_accessed`` (its cost estimate in the backend config)."""
    m = re.search(r'bytes_accessed\\?"?\s*[:=]\s*\\?"?([0-9.e+]+)', attrs)
    return float(m.group(1)) if m else None


class _Counter:
    def __init__(self, computations: dict[str, Computation], loop_trips: int, filled: int | None = None):
        self.computations, self.loop_trips, self.filled = computations, loop_trips, filled
        self.by_opcode: dict[str, float] = {}
        self.unknown_loops = 0

    def computation(self, name: str, times: float) -> float:
        comp = self.computations[name]
        return sum(self.instruction(comp, ins, times) for ins in comp.instructions.values())

    def add(self, opcode: str, n: float, times: float) -> float:
        self.by_opcode[opcode] = self.by_opcode.get(opcode, 0.0) + n * times
        return n * times

    def instruction(self, comp: Computation, ins: Instruction, times: float) -> float:
        op = ins.opcode
        if op in _FREE or op.endswith("-done"):
            return 0.0
        if op == "while":
            body = called(ins.attrs, "body")[0]
            trips = (_loop_trips(self.computations, self.computations[called(ins.attrs, "condition")[0]],
                                 self.computations[body])
                     or _buffer_trips(self.computations, self.computations[body], self.filled))
            if trips is None:
                self.unknown_loops += 1
            return self.computation(body, times * (trips or self.loop_trips))
        if op == "conditional":
            branches = called(ins.attrs, "branch_computations") or (
                called(ins.attrs, "true_computation") + called(ins.attrs, "false_computation"))
            costs = []
            for branch in branches:  # the costliest branch, each counted without recording it first
                probe = _Counter(self.computations, self.loop_trips, self.filled)
                costs.append((probe.computation(branch, times), probe))
            cost, probe = max(costs, key=lambda c: c[0]) if costs else (0.0, None)
            if probe is not None:
                for k, v in probe.by_opcode.items():
                    self.by_opcode[k] = self.by_opcode.get(k, 0.0) + v
                self.unknown_loops += probe.unknown_loops
            return cost
        if op == "call":
            return self.computation(called(ins.attrs, "to_apply")[0], times)
        operands = [comp.instructions[o] for o in ins.operands if o in comp.instructions]
        if op == "fusion":
            return self.add("fusion", self.fusion(ins, operands), times)
        if op == "custom-call" and any(f'custom_call_target="{target}"' in ins.attrs for target in _FREE_CALLS):
            return 0.0
        if _is_pallas(ins):
            declared = _declared_bytes(ins.attrs)
            if declared is not None:
                return self.add("pallas", declared, times)
        if op in _SLICING or op == "slice-start":
            out = [leaf for leaf in ins.leaves if leaf.space < 2][-1]  # slice-start: (source, result, context)
            read = out.bytes if operands and _first_leaf(operands[0]).in_hbm else 0.0
            return self.add(op, read + (out.bytes if out.in_hbm else 0.0), times)
        if op == "dynamic-update-slice":
            update = _first_leaf(operands[1]).bytes
            return self.add(op, (update if _first_leaf(operands[1]).in_hbm else 0.0)
                            + (update if ins.leaves[0].in_hbm else 0.0), times)
        read = sum(leaf.bytes for o in operands for leaf in o.leaves if leaf.in_hbm)
        return self.add(op, read + sum(leaf.bytes for leaf in _results(ins, operands) if leaf.in_hbm), times)

    def fusion(self, ins: Instruction, operands: list[Instruction]) -> float:
        fused = self.computations[called(ins.attrs, "calls")[0]]
        root = fused.root
        root_parts = [fused.instructions[o] for o in root.operands] if root.opcode == "tuple" else [root]
        in_place = {p.name for p in root_parts if p.opcode == "dynamic-update-slice"}
        read = 0.0
        for index, operand in enumerate(operands):
            if not _first_leaf(operand).in_hbm:
                continue
            param = fused.parameter(index).name
            read += _used_bytes(self.computations, fused, param, _first_leaf(operand).bytes, in_place)
        # a Pallas call fused in (a batch loop around it, XLA:TPU's kCustom fusion): the bytes it declares
        read += sum(_declared_bytes(i.attrs) or 0.0 for i in fused.instructions.values() if _is_pallas(i))
        written = 0.0
        for part, leaf in zip(root_parts, ins.leaves if len(root_parts) > 1 else ins.leaves[:1]):
            if leaf.in_hbm:
                written += (fused.instructions[part.operands[1]].leaves[0].bytes
                            if part.opcode == "dynamic-update-slice" else leaf.bytes)
        return read + written


def _is_pallas(ins: Instruction) -> bool:
    return ins.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in ins.attrs


def _first_leaf(ins: Instruction) -> Array:
    return ins.leaves[0] if ins.leaves else Array("token", (), 0)


def _results(ins: Instruction, operands: list[Instruction]) -> list[Array]:
    """What an instruction writes: its result leaves, less (for an asynchronous ``*-start``)
    the operand aliases and the scalar context its tuple carries."""
    if not ins.opcode.endswith("-start"):
        return ins.leaves
    leaves = [leaf for leaf in ins.leaves if leaf.space < 2]
    for operand in operands:
        for alias in operand.leaves:
            match = next((leaf for leaf in leaves if (leaf.dtype, leaf.dims, leaf.space) == (alias.dtype, alias.dims, alias.space)), None)
            if match is not None:
                leaves.remove(match)
    return leaves


def _used_bytes(computations: dict[str, Computation], fused: Computation, param: str, whole: float,
                in_place: set[str], pieces: list[tuple[int, ...]] | None = None) -> float:
    """The bytes a fusion reads of its parameter ``param`` (``whole`` bytes): the pieces its
    users slice or gather when they all do (also inside a fusion nested in it: the attention's
    block of a scanned model's stacked cache), nothing when it is only updated in place, else whole."""
    names, used = [param], 0.0
    while names:
        name = names.pop()
        for user in fused.users(name):
            if user.opcode == "bitcast":
                names.append(user.name)
            elif user.opcode in _SLICING and user.operands[0] == name:
                used += user.leaves[0].bytes
                if pieces is not None:
                    pieces.append(user.leaves[0].dims)
            elif user.opcode == "fusion":
                nested = computations[called(user.attrs, "calls")[0]]
                positions = [i for i, operand in enumerate(user.operands) if operand == name]
                if any(_bitcast_of(nested, i) for i in positions):
                    names.append(user.name)  # a nested fusion that only bitcasts it: follow its users
                    continue
                used += sum(_used_bytes(computations, nested, nested.parameter(i).name, whole, set(), pieces) for i in positions)
            elif user.opcode == "dynamic-update-slice" and user.operands[0] == name and user.name in in_place:
                continue
            elif _is_pallas(user) and _declared_bytes(user.attrs) is not None:
                continue  # a Pallas call inside the fusion: its declared bytes count instead (`_Counter.fusion`)
            else:
                return whole
    return min(used, whole)


def _bitcast_of(fused: Computation, index: int) -> bool:
    """Whether ``fused`` returns its parameter ``index`` bitcast (XLA:TPU wraps a convolution's
    weight so, at batch > 1), and nothing else."""
    root = fused.root
    while root.opcode == "bitcast":
        root = fused.instructions[root.operands[0]]
    return root.opcode == "parameter" and root.name == fused.parameter(index).name


def _loop_trips(computations: dict[str, Computation], cond: Computation, body: Computation) -> int | None:
    """A counted loop's trips (a scan over layers): its condition ``i < N``, N a constant, and its
    body adding 1 to i (from 0, as JAX's scans count) -> N; None for another loop."""
    root, step = cond.root, body.root
    if root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2 or step.opcode != "tuple":
        return None
    counter = cond.instructions.get(root.operands[0])
    index = re.search(r"index=(\d+)", counter.attrs) if counter is not None and counter.opcode == "get-tuple-element" else None
    if index is None or int(index.group(1)) >= len(step.operands):
        return None
    add = body.instructions.get(step.operands[int(index.group(1))])
    if add is None or add.opcode != "add" or not any(_constant(body.instructions.get(o)) == 1 for o in add.operands):
        return None
    return _constant(cond.instructions.get(root.operands[1]))


def _constant(ins: Instruction | None) -> int | None:
    """An integer constant's value (None for another instruction)."""
    literal = ins.attrs.split(")")[0] if ins is not None and ins.opcode == "constant" else ""
    return int(literal) if literal.lstrip("-").isdigit() else None


def _buffer_trips(computations: dict[str, Computation], body: Computation, filled: int | None = None) -> int | None:
    """The trips a loop with a dynamic trip count takes over the largest loop-carried HBM buffer
    its body reads in blocks (decode attention: the cache's key blocks): enough to read it whole,
    or, with ``filled``, the blocks holding its first ``filled`` rows along the walked dimension
    (the slots written at the step counted: decode reads no more); None when its body slices no
    such buffer. A dimension the slices take one index of while the buffer has more is not
    walked by this loop (a scanned model's stacked cache: the attention reads its layer's blocks,
    at a layer fixed for the loop)."""
    trips = None
    for ins in body.instructions.values():
        if ins.opcode != "fusion":
            continue
        fused = computations[called(ins.attrs, "calls")[0]]
        for index, name in enumerate(ins.operands):
            operand = body.instructions.get(name)
            if operand is None or operand.opcode != "get-tuple-element" or not _first_leaf(operand).in_hbm:
                continue
            whole, pieces = _first_leaf(operand).bytes, []
            used = _used_bytes(computations, fused, fused.parameter(index).name, whole, set(), pieces)
            if 0 < used < whole:
                walked = _walked(_first_leaf(operand).dims, pieces)
                count = walked[0] if walked else round(whole / used)
                if walked and walked[1] and filled is not None:
                    count = min(count, -(-filled // walked[1]))
                trips = max(trips or 0, count)
    return trips


def _walked(dims: tuple[int, ...], pieces: list[tuple[int, ...]]) -> tuple[int, int | None] | None:
    """How many of its slices walk a buffer of ``dims`` (along the dimensions where a slice is
    more than one index wide) and, where that is one dimension, a slice's rows along it (else
    None); None if none is walked, or a slice's rank differs (a gather)."""
    best = None
    for piece in pieces:
        if len(piece) != len(dims):
            return None
        walked = [(d // p, p) for d, p in zip(dims, piece) if 1 < p < d]
        count = math.prod(n for n, _ in walked)
        if best is None or count > best[0]:
            best = (count, walked[0][1] if len(walked) == 1 else None)
    return best if best is not None and best[0] > 1 else None


def hbm_traffic(hlo_text: str, *, loop_trips: int = 1, filled: int | None = None) -> dict:
    """The HBM bytes one run of a compiled program moves (module docstring), from
    ``compiled.as_text()``: ``{"bytes": total, "by_opcode": {...}, "unknown_trip_loops": n}``.
    ``filled``: the cache slots written at the step counted (None: a loop over the cache reads it whole)."""
    computations, entry = parse_module(hlo_text)
    counter = _Counter(computations, loop_trips, filled)
    total = counter.computation(entry, 1.0)
    return {"bytes": total, "by_opcode": dict(sorted(counter.by_opcode.items(), key=lambda kv: -kv[1])),
            "unknown_trip_loops": counter.unknown_loops, "loop_trips": loop_trips, "filled": filled}


if __name__ == "__main__":  # python -m popjax.analysis.hbm_traffic FILE.hlo.txt [LOOP_TRIPS]
    print(json.dumps(hbm_traffic(Path(sys.argv[1]).read_text(), loop_trips=int(sys.argv[2]) if len(sys.argv) > 2 else 1), indent=1))
