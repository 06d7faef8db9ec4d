"""TPU slices as compile targets on any machine: a topology name -> its devices, chip and memory.

``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4")`` asks
libtpu (the ``tpu`` extra: ``pip install -e ".[tpu]"``) for the devices of a slice without any TPU
attached; a `jax.sharding.Mesh` of them makes ``jit(...).lower(...).compile()`` run the real TPU
compiler (XLA:TPU) on this CPU. JAX itself stays on its CPU backend: nothing here changes
``jax.devices()``.

libtpu's start-up asks the TPU VM's metadata for the accelerator type and worker hostnames; off a
TPU VM it warns on stderr and fails to find host bounds. `prepare_libtpu_env` sets those to a
neutral single-host value before libtpu loads (only when no TPU is attached: on a TPU VM the
runtime's own values stand) and lets several processes load libtpu at once (test workers, a
notebook beside a CLI run): compile-only use never claims a chip.

Per-chip HBM capacity and bandwidth (`CHIPS`), from Google Cloud's TPU system-architecture pages:
  v4   https://cloud.google.com/tpu/docs/v4   "HBM2 capacity and bandwidth: 32 GiB, 1200 GBps"
       (two TensorCores per chip; libtpu lists each core as a device, so each device has half)
  v5e  https://cloud.google.com/tpu/docs/v5e  "HBM2 capacity and bandwidth: 16 GB, 819 GBps"
  v5p  https://cloud.google.com/tpu/docs/v5p  "HBM2e capacity and bandwidth: 95 GB, 2765 GBps"
       (95 GiB user-allocatable of 96 GiB physical; one megacore device per chip)
  v6e  https://cloud.google.com/tpu/docs/v6e  "HBM capacity per chip: 32 GB; HBM bandwidth per chip: 1638 GBps"
Capacities are taken as GiB (the HBM stacks are binary-sized; v5p's page states GiB), bandwidths as
10⁹ bytes/s. They are the denominators of the fit check and of the roofline *estimate* of decode
speed (`popjax.analysis.tpu_compile`), never measurements.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from ..libtpu_env import prepare_libtpu_env
from ..sharding import make_mesh

GiB = 1024**3
GB = 10**9

# libtpu's device_kind -> the chip's key in CHIPS
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
EXAMPLES = ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v5e:4x4", "v6e:2x4", "v5p:2x2x1", "v5p:2x2x2", "v4:2x2x1")
TPU_EXTRA = 'libtpu is not installed: TPU compile targets need it: pip install -e ".[tpu]" (or the test extra)'


class LibTPUMissing(ImportError, ValueError):
    """libtpu is not installed (an ImportError; a ValueError too, so the CLI reports it in one line)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip generation: HBM bytes and HBM bandwidth (bytes/s) per chip (sources above)."""

    name: str
    hbm_bytes: int
    hbm_bandwidth: float


CHIPS = {
    "v4": Chip("v4", 32 * GiB, 1200 * GB),
    "v5e": Chip("v5e", 16 * GiB, 819 * GB),
    "v5p": Chip("v5p", 95 * GiB, 2765 * GB),
    "v6e": Chip("v6e", 32 * GiB, 1638 * GB),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A resolved TPU slice: its devices (what a mesh is built from), chip generation, chips,
    processes (hosts) and each device's share of a chip's HBM and bandwidth."""

    name: str
    devices: tuple
    chip: Chip
    chips: int
    processes: int

    @property
    def devices_per_chip(self) -> int:
        return len(self.devices) // self.chips

    @property
    def hbm_per_device(self) -> int:
        return self.chip.hbm_bytes // self.devices_per_chip

    @property
    def bandwidth_per_device(self) -> float:
        return self.chip.hbm_bandwidth / self.devices_per_chip

    def describe(self) -> dict:
        return {"name": self.name, "chip": self.chip.name, "chips": self.chips, "devices": len(self.devices),
                "processes": self.processes, "hbm_per_device": self.hbm_per_device,
                "hbm_bandwidth_per_device": self.bandwidth_per_device}


def require_libtpu() -> None:
    """`LibTPUMissing` (an ImportError) naming the extra when libtpu is missing."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise LibTPUMissing(TPU_EXTRA) from None


def resolve_topology(name: str) -> Topology:
    """``"v5e:2x4"`` (generation:shape, as libtpu names slices) -> its `Topology`.

    ValueError for a name libtpu does not resolve (listing valid forms) or a chip without an
    HBM entry; `LibTPUMissing` naming the extra when libtpu is missing."""
    if not isinstance(name, str) or not re.fullmatch(r"v[0-9][a-z]*:[0-9]+(x[0-9]+){1,2}", name.strip().lower()):
        raise ValueError(f"topology {name!r} is not GENERATION:SHAPE; valid forms: {', '.join(EXAMPLES)}")
    name = name.strip().lower()
    require_libtpu()
    prepare_libtpu_env()
    from jax.experimental import topologies  # here: it loads libtpu, which must start after its environment is set

    shape = [int(s) for s in name.split(":")[1].split("x")]
    # a slice smaller than libtpu's default host (2x2x1 chips) is one host holding all of it
    bounds = {"chips_per_host_bounds": tuple(shape + [1] * (3 - len(shape)))} if np.prod(shape) < 4 else {}
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name, **bounds)
    except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"topology {name!r} is not one libtpu resolves ({first}); valid forms: {', '.join(EXAMPLES)}") from None
    devices = tuple(desc.devices)
    kind = devices[0].device_kind
    if kind not in DEVICE_KINDS:
        raise ValueError(f"topology {name!r} has chips of kind {kind!r}, without an HBM entry; known: {sorted(CHIPS)}")
    chips = len({tuple(d.coords) for d in devices})
    return Topology(name, devices, CHIPS[DEVICE_KINDS[kind]], chips, len({d.process_index for d in devices}))


def topology_mesh(topology: Topology, shape: tuple[int, int]) -> jax.sharding.Mesh:
    """A ``("data", "model")`` mesh over every device of ``topology``; ValueError when
    data × model is not its device count (naming the shapes that cover it)."""
    data, model = shape
    n = len(topology.devices)
    if data * model != n:
        valid = [f"{d}x{n // d}" for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"mesh {data}x{model} ({data * model} devices) does not cover topology {topology.name} "
                         f"({n} devices); valid meshes: {', '.join(valid)}")
    return make_mesh((data, model), devices=list(topology.devices))
