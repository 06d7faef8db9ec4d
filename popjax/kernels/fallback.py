"""Safe ``kernel="auto"``: a Pallas kernel is built alone, at the shapes the program calls it
with, before the program that calls it is compiled; one that does not build raises
`KernelUnavailable`, which the layer that binds methods turns into XLA (``"auto"``) or an error
(``"pallas"``), and what ran is recorded per plan.

Why here and not around the engine call: XLA compiles the engine's whole program at once, so a
Mosaic or Triton failure would surface only after minutes of compiling, as an error that does
not say which kernel failed, and after the prefill has run with the kernel's plan (whose state a
decode through XLA may not read). The kernels' shapes (batch bucket, per-sequence rows, chunks
of `ffn_layout.MAX_BATCH`, held rows) are only known once the engine traces, so the trial runs
where each kernel is first traced (`decode_ffn`: `trial`), on its own operands' shapes, cached
per (kernel, resolved kernel, device kind, mesh, shapes, static arguments); the binding layer traces
the engine's programs abstractly once per request shape (``jax.eval_shape``: nothing runs, no
whole program compiles) to reach those calls (`popjax.requests.GenerationRequest.create`,
`popjax.analysis.tpu_compile.compile_method`).

What a trial covers: tracing and lowering the kernel for its platform always (Mosaic's and
Triton's own checks, popjax's VMEM and shared-memory refusals); compiling it where a backend
of that platform is present (a TPU or GPU machine). Compiling for a TPU from a CPU
(``popjax compile``) lowers only: the whole program's compile then reports any Mosaic error.
Interpret mode compiles nothing for a chip and is not tried (`TRIED`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Hashable

import jax

from . import RESOLVED
from .chips import device_kind

# the resolved kernels a platform compiler builds (interpret mode runs on XLA:CPU: not tried)
TRIED = ("pallas-tpu", "pallas-gpu")
_PLATFORMS = {"pallas-tpu": "tpu", "pallas-gpu": "cuda"}


class KernelUnavailable(ValueError):
    """A Pallas kernel does not build (trace, lower or compile) for the device at these shapes.
    ``kernel``: its name ("gather_matvec"); ``resolved``: what ran it ("pallas-tpu"); ``line``:
    the first line of the compiler's (or popjax's) error."""

    def __init__(self, kernel: str, resolved: str, where: str, line: str):
        self.kernel, self.resolved, self.line = kernel, resolved, line
        super().__init__(f"the Pallas kernel {kernel} ({resolved}) does not build for {where}: {line}")


# (kernel, resolved, device kind, mesh axes, treedef, operand shapes, static) -> None (builds) or the error
_TRIALS: dict[Hashable, KernelUnavailable | None] = {}
# a plan bound with a Pallas kernel -> what its programs ran instead ("xla (fallback: ...)")
_FALLBACKS: dict[Hashable, str] = {}


def first_line(err: BaseException) -> str:
    """The first non-empty line of an error's message (the compiler's verdict), else its type."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


def trial(name: str, resolved: str, call: Callable, args: tuple, static: Hashable = ()) -> None:
    """Builds ``call(*args)`` alone for ``resolved``'s platform (jit, trace, lower; compile where
    that platform's backend is present) on ``args``' shapes and dtypes, once per key (module
    docstring); raises `KernelUnavailable` when it does not build. ``static``: whatever else
    ``call`` closes over that changes the kernel (out_features, act, block). A no-op for a
    resolved kernel not in `TRIED`."""
    if resolved not in TRIED:
        return
    leaves, treedef = jax.tree_util.tree_flatten(args)
    shapes = tuple((tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else a for a in leaves)
    kind, mesh = device_kind(), jax.sharding.get_abstract_mesh()
    key = (name, resolved, kind, () if mesh.empty else tuple(mesh.shape.items()), treedef, shapes, static)
    if key not in _TRIALS:
        _TRIALS[key] = _build(name, resolved, kind, call, treedef, leaves)
    if _TRIALS[key] is not None:
        raise _TRIALS[key]


def _build(name: str, resolved: str, kind: str, call: Callable, treedef, leaves) -> KernelUnavailable | None:
    platform = _PLATFORMS[resolved]
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a for a in leaves]
    here = jax.default_backend() in (("tpu",) if platform == "tpu" else ("gpu", "cuda", "rocm"))
    try:
        traced = jax.jit(lambda *ops: call(*jax.tree_util.tree_unflatten(treedef, ops))).trace(*abstract)
        lowered = traced.lower() if here else traced.lower(lowering_platforms=(platform,))
        if here:
            lowered.compile()
    except Exception as err:  # noqa: BLE001 - any failure to build means this kernel cannot serve these shapes
        return KernelUnavailable(name, resolved, kind, first_line(err))
    return None


def record_fallback(plan: Hashable, err: KernelUnavailable) -> str:
    """Records that ``plan``'s programs run through XLA because of ``err`` -> the record
    ("xla (fallback: <kernel>: <first error line>)") that `ran` gives for ``plan`` from now on."""
    note = f"xla (fallback: {err.kernel}: {err.line})"
    _FALLBACKS[plan] = note
    return note


def fell_back(plan: Hashable) -> str | None:
    """The fallback record of ``plan`` (`record_fallback`), else None."""
    return _FALLBACKS.get(plan)


def plan_kernel(plan: Any) -> str:
    """The resolved kernel (`RESOLVED`) a plan's decode step reads its rows through: its own
    ``kernel`` field, else a nested plan's (a layer-level plan around an FFN plan), else "xla"."""
    kernel = getattr(plan, "kernel", None)
    if kernel in RESOLVED:
        return kernel
    if dataclasses.is_dataclass(plan):
        for f in dataclasses.fields(plan):
            inner = getattr(plan, f.name, None)
            if dataclasses.is_dataclass(inner) and not isinstance(inner, type):
                found = plan_kernel(inner)
                if found != "xla":
                    return found
    return "xla"


def ran(plan: Any) -> str:
    """What a plan's decode step read its rows through, for records (bench and compile JSON):
    "xla (fallback: ...)" where the binding layer fell back from it, else `plan_kernel`."""
    return fell_back(plan) or plan_kernel(plan)


def warn_fallback(label: str, err: KernelUnavailable) -> None:
    """The one warning of a fallback: the method, the kernel and the compiler's first line."""
    warnings.warn(f"{label}: kernel='auto' falls back to XLA: the Pallas kernel {err.kernel} ({err.resolved}) does not "
                  f"build for {device_kind()}: {err.line}", RuntimeWarning, stacklevel=4)


def fall_back(label: str, kernel_option: str, plan: Hashable, err: KernelUnavailable) -> str:
    """What the binding layer does when ``plan``'s kernel does not build: a method that asked for
    ``kernel="pallas"`` (``kernel_option``) raises `explicit_error`; one on ``"auto"`` gets the one
    warning and the record -> that record ("xla (fallback: ...)"); the caller rebinds it through XLA."""
    if kernel_option != "auto":
        raise explicit_error(label, err) from None
    warn_fallback(label, err)
    return record_fallback(plan, err)


def explicit_error(label: str, err: KernelUnavailable) -> KernelUnavailable:
    """The error for a method that asked for ``kernel="pallas"`` explicitly: no fallback."""
    out = KernelUnavailable(err.kernel, err.resolved, device_kind(), err.line)
    out.args = (f"{label}: kernel='pallas' was asked for and {err}; use kernel='auto' (falls back to XLA) or 'xla'",)
    return out
