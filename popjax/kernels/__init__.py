"""The kernels home: the compute the model's layers and the methods' plans call, behind small
functional interfaces, so that a faster kernel for one platform drops in at one place.

* `attention`: prefill (causal, flash-style beyond one block) and the one decode kernel every
  cached layer runs, over a block reader (a layer's cache, a ring, a scanned model's stack).
* `int8`: the int8 weight format (`Int8Weight`: int8 values, per-output-channel scales) and
  its dot forms (`dot`: weight-only or int8 activations, two passes for outlier-heavy inputs).
* `ffn_layout`: the decode-FFN kernels' weight layouts (`ChannelRows`, `InputRows`,
  `OutputRows`; the block slab in `block_slab`); `held_rows` a scanned model's stacked rows;
  `selection` how a choice of rows becomes what a kernel reads;
  `traffic` the bytes each moves per call; `ffn_tpu` (Mosaic: `block_ffn`, `gather_ffn`),
  `matvec_tpu` (`gather_matvec`, `values_matvec`, `block_matvec`, `masked_matvec`,
  `gather_row_dots`) and `ffn_gpu` (Triton: the same) read only the weight rows or blocks a
  decode step selected (docs/kernels.md).
* Here: `choose`, the ONE place that maps a method's ``kernel`` hyper-parameter ("auto",
  "xla", "pallas") to what runs on this platform (`RESOLVED`); `decode_ffn` calls the kernel a
  resolved value names (a plan imports it; importing this package does not load Pallas), each
  first built alone (`fallback`: "auto" falls back to XLA where one does not build); `chips`
  the device the kernels size for (a TPU's VMEM, a GPU's SMs and shared memory, by device kind).

This package imports nothing else of popjax: it is the bottom layer of the import contract.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

KERNELS = ("auto", "xla", "pallas")  # what a method's ``kernel`` hyper-parameter takes
# what `choose` resolves to: XLA's ops, or the Pallas kernels of one platform; "pallas-interpret"
# runs the TPU kernels in Pallas' interpret mode (a CPU, when "pallas" is forced: the tests)
RESOLVED = ("xla", "pallas-tpu", "pallas-gpu", "pallas-interpret")
# the resolved values that run the TPU kernels (compiled by Mosaic, or in interpret mode): they
# read a weight row whole, its L·128 lanes (`ffn_layout.channel_lines`)
TPU_KERNELS = ("pallas-tpu", "pallas-interpret")
_PALLAS_BACKENDS = {"tpu": "pallas-tpu", "gpu": "pallas-gpu", "cuda": "pallas-gpu"}
# the platform programs are being compiled for, where it is not JAX's own backend (`compiling_for`)
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("popjax_kernel_target", default=None)


@contextlib.contextmanager
def compiling_for(backend: str) -> Iterator[None]:
    """Within the block, `choose` resolves for ``backend`` ("tpu", "gpu", "cpu") instead of JAX's
    default backend: programs compiled from this machine for another platform (`popjax compile`:
    a TPU slice's programs from a CPU) bind that platform's kernels."""
    token = _TARGET.set(backend)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_backend() -> str:
    """The platform programs traced now run on: the `compiling_for` target, else JAX's default
    backend (what shape choices made for one platform ask: `sharding.pad_ids`)."""
    return _TARGET.get() or jax.default_backend()


def choose(kernel: str, backend: str | None = None) -> str:
    """``kernel`` ("auto", "xla" or "pallas") -> one of `RESOLVED` for ``backend`` (default: the
    `compiling_for` target, else ``jax.default_backend()``): "auto" is Pallas on TPU and GPU and
    XLA elsewhere; "pallas" on a platform without a compiled kernel (a CPU) is interpret mode.
    ValueError on another value."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    backend = backend or target_backend()
    if kernel == "xla" or (kernel == "auto" and backend not in _PALLAS_BACKENDS):
        return "xla"
    return _PALLAS_BACKENDS.get(backend, "pallas-interpret")
