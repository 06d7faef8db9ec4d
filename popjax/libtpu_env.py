"""The environment libtpu needs off a TPU VM, set just before libtpu starts and never otherwise.

libtpu (the ``tpu`` extra: popjax compiles for TPU slices on any machine, docs/tpu.md) starts in
two places: `popjax.analysis.topologies.resolve_topology` (``popjax compile``) loads it to list a
slice's devices, and JAX's first backend start loads it when it is installed and ``JAX_PLATFORMS``
does not leave the TPU out. Off a TPU VM it then asks the VM's metadata server for its accelerator
type and workers and warns on stderr before JAX falls back to the CPU. `prepare_libtpu_env` sets
neutral single-host values (`VARIABLES`) first, only those the user has not set, and nothing on a
machine with TPU chips.

``import popjax`` sets no variable: it calls `prepare_when_libtpu_starts`, which wraps JAX's TPU
backend factory so that `prepare_libtpu_env` runs inside it, right before libtpu loads, and only
where libtpu is installed. On a GPU or CPU machine whose JAX never starts libtpu (no libtpu, or
``JAX_PLATFORMS=cpu``/``cuda``) the environment stays as the user left it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

log = logging.getLogger(__name__)

# name -> value; a name the user set keeps the user's value
VARIABLES = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # compile-only: no chip to claim, so test workers and a notebook load it side by side
    "TPU_SKIP_MDS_QUERY": "1",  # no metadata server to ask off a TPU VM
    "TPU_ACCELERATOR_TYPE": "v5litepod-4",  # host bounds of a single host: any slice compiles
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
    "GRPC_VERBOSITY": "ERROR",  # libtpu's gRPC start-up chatter
}


def prepare_libtpu_env() -> None:
    """Sets `VARIABLES` for libtpu off a TPU VM; call it just before libtpu loads (later calls
    change nothing libtpu reads). Values a user set are kept; on a machine with TPU chips nothing
    is set (the TPU runtime's own values stand)."""
    if _tpu_attached():
        return
    for name, value in VARIABLES.items():
        os.environ.setdefault(name, value)


def prepare_when_libtpu_starts() -> None:
    """Makes JAX's TPU backend factory call `prepare_libtpu_env` before it loads libtpu (once;
    ``import popjax`` calls this). The factory is JAX's private registry entry: where it is absent
    (another JAX), nothing is wrapped and an installed libtpu just warns on stderr at start-up."""
    try:
        from jax._src import xla_bridge  # private: the registry of backend factories
    except ImportError:
        return
    registration = getattr(xla_bridge, "_backend_factories", {}).get("tpu")
    if registration is None or getattr(registration.factory, "_popjax_prepared", False):
        return
    factory = registration.factory

    @functools.wraps(factory)
    def prepared(*args, **kwargs):
        if libtpu_installed():  # the factory is about to load libtpu (without it, it fails quietly)
            prepare_libtpu_env()
        return factory(*args, **kwargs)

    prepared._popjax_prepared = True
    try:
        registration.factory = prepared
    except (AttributeError, TypeError) as err:  # a frozen registration in another JAX
        log.debug("libtpu's environment is not prepared at JAX's backend start: %s", err)


def libtpu_installed() -> bool:
    """Whether JAX's TPU backend would find libtpu: ``TPU_LIBRARY_PATH`` names a file, or the
    ``libtpu`` package is installed (looked up without importing it)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    return bool(path and os.path.isfile(path)) or importlib.util.find_spec("libtpu") is not None


def _tpu_attached() -> bool:
    """Whether this machine has TPU chips (JAX's own probe of the PCI devices)."""
    try:
        from jax._src import hardware_utils  # private: without it, assume none
    except ImportError:
        return False
    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
