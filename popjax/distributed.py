"""Multi-host: one JAX program over the devices of several processes (hosts).

Every process runs the same popjax code on the same inputs (SPMD). ``initialize`` joins the
processes into one JAX runtime (``jax.distributed.initialize``), after checking its arguments
and that the coordinator answers, because a failed connect inside JAX aborts the process with
a C++ stack instead of raising. After it, ``jax.devices()`` lists every process's devices and a
``popjax.sharding.make_mesh`` mesh spans them all (`check_global_mesh`).

Outputs. A jitted program's output on a multi-process mesh is not fully addressable: each
process holds only its own devices' blocks and ``np.asarray`` refuses it. `to_host` gathers
such arrays (``multihost_utils.process_allgather``), so every process reads the same NumPy
values; `replicated` gives a device array a replicated sharding instead (``np.asarray`` then
reads a local copy). On one process both are ``np.asarray`` / the array itself.

Side effects. `is_main` is true on process 0 only: printing, streaming, JSON, reports and
plots happen there (the others compute the same values and stay silent).

Every wait on another process has a timeout (`initialize`'s ``timeout_s``; `barrier`'s).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import jax
import numpy as np
from jax._src import distributed as jax_distributed  # JAX's coordination client: no public query or timed barrier
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

# The environment variables that stand in for the CLI flags (JAX's own names, read by
# `jax.distributed.initialize` on some clusters too).
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
DEFAULT_TIMEOUT_S = 300  # jax.distributed.initialize's own default
BARRIER_TIMEOUT_S = 600  # end-of-command barrier: a slower host finishing its last write


def parse_coordinator(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); ValueError naming the value otherwise."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator {address!r} must be HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:1234")
    return host.strip("[]"), int(port)


def check_process_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Validates the three values before anything waits on another process: a process count
    ≥ 1, a process id in [0, num_processes), a HOST:PORT coordinator when there are several."""
    if num_processes is None or process_id is None:
        raise ValueError("multi-host needs --num-processes N and --process-id I with --coordinator "
                         f"(or {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID})")
    if num_processes < 1:
        raise ValueError(f"--num-processes {num_processes} is invalid; use an integer ≥ 1")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} is out of range; with --num-processes {num_processes} "
                         f"it must be in 0..{num_processes - 1}")
    if num_processes > 1:
        if coordinator is None:
            raise ValueError(f"--num-processes {num_processes} needs --coordinator HOST:PORT (process 0's address)")
        parse_coordinator(coordinator)


def is_initialized() -> bool:
    """Whether ``jax.distributed.initialize`` has run in this process."""
    return jax_distributed.global_state.client is not None


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Polls the coordinator's TCP port until it accepts a connection; after ``timeout_s`` a
    ValueError saying it is not reachable (JAX's own connect would abort the process)."""
    host, port = parse_coordinator(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(timeout_s, 0.1))):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"coordinator {address} is not reachable after {timeout_s:g} s ({type(err).__name__}: {err}); "
                    "start process 0 with the same --coordinator, or check the address and port"
                ) from None
            time.sleep(0.2)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Joins this process to the others (``jax.distributed.initialize``) after validating the
    arguments; None arguments come from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``. With none of the three anywhere, JAX's cluster auto-detection runs (TPU
    pods, SLURM, ...). A second call in an initialized process does nothing. CPU processes use
    gloo collectives. Must run before any other JAX call touches the devices."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if timeout_s <= 0:
        raise ValueError(f"the initialization timeout {timeout_s} s is invalid; use a number of seconds > 0")
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit:
        check_process_args(coordinator, num_processes, process_id)
    if is_initialized():
        if explicit and (jax.process_count(), jax.process_index()) != (num_processes, process_id):
            raise ValueError(f"this process is already process {jax.process_index()} of {jax.process_count()}; "
                             f"it cannot become process {process_id} of {num_processes}")
        return
    if explicit and num_processes == 1:
        return  # one process: nothing to join
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk through gloo
    if explicit and process_id != 0:  # process 0 serves the coordinator; the others must reach it
        wait_for_coordinator(coordinator, timeout_s)
    kwargs = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id) if explicit else {}
    jax.distributed.initialize(**kwargs, initialization_timeout=max(1, int(timeout_s)))
    log.info("popjax: process %d of %d, %d of %d devices here", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def is_main() -> bool:
    """True on process 0 (always, on one process): the process that prints and writes files."""
    return jax.process_index() == 0


def check_global_mesh(shape: tuple[int, int]) -> None:
    """On several processes a mesh must cover every device of every process (a process left
    out would hold no block of the model, yet run the same program): ValueError otherwise."""
    data, model = shape
    total = jax.device_count()
    if jax.process_count() == 1 or (data * model == total and -1 not in shape):
        return
    if -1 in shape and total % (model if data == -1 else data) == 0:
        return
    raise ValueError(
        f"mesh {data}x{model} does not cover the {total} devices of {jax.process_count()} processes "
        f"({jax.local_device_count()} each); a multi-host mesh needs DATA·MODEL = {total}, e.g. "
        f"{jax.process_count()}x{jax.local_device_count()}"
    )


def default_mesh_shape() -> tuple[int, int] | None:
    """The mesh the CLI uses when none is given: none on one process; on several, data over
    the processes and model over each process's devices (tensor parallelism stays inside a
    host, where the links are fast; only batch rows cross hosts)."""
    if jax.process_count() == 1:
        return None
    return jax.process_count(), jax.local_device_count()


def spans_processes(x: Any) -> bool:
    """Whether ``x`` is a device array with blocks on other processes' devices."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def replicated(x: Any) -> Any:
    """A device array spread over several processes -> the same values replicated on every
    device of its mesh (``np.asarray`` then works on every process); anything else unchanged."""
    if not spans_processes(x):
        return x
    return jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)


def to_host(tree: Any) -> Any:
    """Every array leaf of ``tree`` -> a NumPy array with the global values, identical on every
    process (arrays spread over processes are all-gathered); one process: ``np.asarray``."""
    def leaf(x):
        if spans_processes(x):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree_util.tree_map(leaf, tree)


def everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every process (one all-gather of one bool each): a decision
    all processes take alike, e.g. to run a collective program or not. One process: ``flag``."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.all(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Waits until every process reaches ``name``, at most ``timeout_s`` (then JAX raises a
    DEADLINE_EXCEEDED error naming the barrier); nothing on one process."""
    if jax.process_count() == 1:
        return
    jax_distributed.global_state.client.wait_at_barrier(f"popjax:{name}", int(timeout_s * 1000))
