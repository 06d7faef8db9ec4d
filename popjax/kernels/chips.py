"""The accelerator a kernel is built for, from ``jax.Device.device_kind``: a TPU's VMEM (what
`ffn_tpu.vmem_limit` sizes every Mosaic kernel's scoped VMEM by) and a GPU's streaming
multiprocessors and shared memory (what `ffn_gpu` sizes its split-K programs and checks its
staged tiles by), instead of assuming a v5e or an H100.

Sources of the figures:

* TPU VMEM per TensorCore: jax's own chip table (``jax/_src/pallas/mosaic/tpu_info.py`` of
  jax 0.10.2, `pltpu.get_tpu_info_for_chip`, maintained beside Mosaic): v4 16 MiB, v5e 128 MiB,
  v5p 64 MiB, v6e 128 MiB, v7x 64 MiB. Google's TPU pages (cloud.google.com/tpu/docs/v4, v5e,
  v5p, v6e, tpu7x) state HBM, not VMEM; the table is the only published per-core figure found.
* TPU default scoped VMEM (the limit a kernel gets without ``vmem_limit_bytes``): measured for
  v5e (16 MiB), v6e (32 MiB) and v5p (16 MiB) from libtpu 0.0.42's own error on a kernel over
  it (`default_scoped_vmem` in benchmarks/kernels_compile.py, docs/kernels.md). v4's 16 MiB and
  v7x's 32 MiB are ASSUMPTIONS (v4: its whole VMEM; v7x: v6e's); the kernels set their limit
  from their own estimate anyway, so this is only the floor of that limit.
* GPU shared memory: NVIDIA's CUDA C++ Programming Guide, "Technical Specifications per Compute
  Capability": compute capability 8.0 (A100) 164 KB per SM, 163 KB per thread block; 9.0
  (H100, H200) 228 KB per SM, 227 KB per thread block (A100's 167936 bytes per SM is also what
  ``deviceQuery`` prints). SM counts: A100 108, H100 SXM and H200 132, H100 PCIe 114 (NVIDIA's
  A100 and H100 datasheets and Hopper whitepaper).

An unknown device kind gets the smallest figures of its family (a TPU: v4's VMEM; a GPU: the
A100's) with one warning per kind: a kernel then refuses sooner rather than overrun.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax

KiB, MiB = 1 << 10, 1 << 20

# libtpu's device_kind -> popjax's chip name (jax's `tpu_info.chip_version_from_device_kind` names)
TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
             "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU7x": "v7x"}


@dataclasses.dataclass(frozen=True)
class TPUChip:
    """One TPU generation as the kernels size for it: VMEM per TensorCore and the default scoped
    limit (bytes; sources in the module docstring)."""

    name: str
    vmem_bytes: int
    default_scoped_vmem: int


TPU_CHIPS = {
    "v4": TPUChip("v4", 16 * MiB, 16 * MiB),  # scoped: assumption
    "v5e": TPUChip("v5e", 128 * MiB, 16 * MiB),
    "v5p": TPUChip("v5p", 64 * MiB, 16 * MiB),
    "v6e": TPUChip("v6e", 128 * MiB, 32 * MiB),
    "v7x": TPUChip("v7x", 64 * MiB, 32 * MiB),  # scoped: assumption
}
# a TPU kind not in TPU_KINDS: the smallest VMEM of the table
UNKNOWN_TPU = TPUChip("unknown TPU", 16 * MiB, 16 * MiB)
# what interpret mode sizes for, and a CPU host lowering TPU kernels with no TPU to name (no
# topology's mesh: the compile tests): nothing is compiled for a chip there; the kernels were
# measured on a v5e first, and their tests' limits are v5e's
INTERPRET_CHIP = "v5e"
HOST_KINDS = ("cpu",)  # device kinds of a host with no accelerator (not an unknown accelerator)


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU as the Triton kernels size for it: streaming multiprocessors, shared memory per
    SM and the most one thread block may use (bytes; sources in the module docstring)."""

    name: str
    sms: int
    smem_per_sm: int
    smem_per_block: int


_HOPPER, _AMPERE = (228 * KiB, 227 * KiB), (164 * KiB, 163 * KiB)
# matched in order against the device kind ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", ...)
GPU_SPECS = (
    ("H200", GPUSpec("H200", 132, *_HOPPER)),
    ("H100 PCIe", GPUSpec("H100 PCIe", 114, *_HOPPER)),
    ("H100", GPUSpec("H100", 132, *_HOPPER)),
    ("A100", GPUSpec("A100", 108, *_AMPERE)),
)
UNKNOWN_GPU = GPUSpec("unknown GPU", 108, *_AMPERE)  # the table's smallest
# what interpret mode sizes the GPU kernels for (their split count: two programs per H100 SM)
INTERPRET_GPU = GPUSpec("H100", 132, *_HOPPER)

_warned: set[str] = set()


def device_kind() -> str:
    """The kind of device programs traced now run on: the abstract mesh's device where one is set
    (a TPU slice's programs compiled from a CPU: `popjax compile`), else JAX's first device."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None) if not mesh.empty else None
    return device.device_kind if device is not None else jax.devices()[0].device_kind


def _warn_once(kind: str, family: str, default) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"device kind {kind!r} is not a {family} popjax knows; the kernels size for {default.name}'s "
                      f"figures ({default}), the smallest known", RuntimeWarning, stacklevel=3)


def tpu_chip(chip: str | None = None, interpret: bool = False) -> TPUChip:
    """The TPU a Mosaic kernel sizes its VMEM for: ``chip`` by name ("v4", "v5e", "v5p", "v6e",
    "v7x"; ValueError on another), else `INTERPRET_CHIP` in interpret mode or on a host with no
    accelerator, else the current device kind's (an unknown kind: `UNKNOWN_TPU`, one warning
    per kind)."""
    if chip is not None:
        if chip not in TPU_CHIPS:
            raise ValueError(f"chip={chip!r} is not a known TPU; use one of {list(TPU_CHIPS)}")
        return TPU_CHIPS[chip]
    kind = "cpu" if interpret else device_kind()
    if kind in HOST_KINDS:
        return TPU_CHIPS[INTERPRET_CHIP]
    if kind in TPU_KINDS:
        return TPU_CHIPS[TPU_KINDS[kind]]
    _warn_once(kind, "TPU", UNKNOWN_TPU)
    return UNKNOWN_TPU


def gpu_spec(interpret: bool = False) -> GPUSpec:
    """The GPU a Triton kernel sizes for: `INTERPRET_GPU` in interpret mode or on a host with no
    accelerator (lowering for CUDA from a CPU), else the current device kind's (an unknown
    kind: `UNKNOWN_GPU`, one warning per kind)."""
    kind = "cpu" if interpret else device_kind()
    if kind in HOST_KINDS:
        return INTERPRET_GPU
    for key, spec in GPU_SPECS:
        if key in kind:
            return spec
    _warn_once(kind, "GPU", UNKNOWN_GPU)
    return UNKNOWN_GPU
