"""The environment libtpu needs off a TPU VM, set before JAX's first backend start.

With libtpu installed (popjax compiles for TPU slices on any machine: docs/tpu.md) and
``JAX_PLATFORMS`` unset, JAX's first backend start loads libtpu, which asks a TPU VM's metadata
server for its accelerator type and workers and warns on stderr before JAX falls back to the CPU.
``import popjax`` calls `prepare_libtpu_env` first, so that start is quiet; it sets only values
the user has not set, and nothing on a machine with TPU chips.
"""

from __future__ import annotations

import os


def prepare_libtpu_env() -> None:
    """Environment for libtpu off a TPU VM, set before its first load (``import popjax`` calls
    this: with libtpu installed and JAX_PLATFORMS unset, JAX's first backend start loads libtpu,
    which then warns on stderr before JAX falls back to the CPU). Quiet start-up, several
    processes at once (compile-only use claims no chip). Values a user set are kept; on a
    machine with TPU chips nothing is set."""
    if _tpu_attached():
        return
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no chip to claim
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask off a TPU VM
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # host bounds of a single host: any slice compiles
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_WORKER_ID", "0")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def _tpu_attached() -> bool:
    """Whether this machine has TPU chips (JAX's own probe of the PCI devices)."""
    try:
        from jax._src import hardware_utils  # private: without it, assume none
    except ImportError:
        return False
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
