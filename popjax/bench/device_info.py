"""What ``popjax device-check`` records of the machine it ran on: the devices, every version that
decides what a kernel compiles to (jax, jaxlib, their plugins, flax, triton, libtpu, CUDA and
the driver where visible), and JAX's own environment report. Read without importing the
packages (``importlib.metadata``): torch or triton are never loaded only to name a version."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

import jax

# distributions whose versions decide the compiled kernels (the plugin names JAX's own wheels use)
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "optax", "orbax-checkpoint", "chex", "triton", "libtpu",
            "torch", "transformers")
PLUGIN_PREFIXES = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "jax-tpu", "nvidia-")


def package_versions() -> dict[str, str | None]:
    """Version of each of `PACKAGES` and of every installed JAX plugin or NVIDIA library
    wheel (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        if name.startswith(PLUGIN_PREFIXES):
            out[name] = dist.version
    return out


def nvidia_smi(timeout_s: float = 20.0) -> dict[str, Any] | None:
    """The GPUs as ``nvidia-smi`` reports them (name, driver, memory, CUDA version), or None
    where it is absent or fails (a CPU or TPU machine)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    query = [exe, "--query-gpu=name,driver_version,memory.total,clocks.max.memory,pcie.link.gen.max", "--format=csv,noheader"]
    try:
        rows = subprocess.run(query, capture_output=True, text=True, timeout=timeout_s, check=True).stdout.strip().splitlines()
        header = subprocess.run([exe], capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    cuda = next((line.split("CUDA Version:")[1].split()[0] for line in header.splitlines() if "CUDA Version:" in line), None)
    fields = ("name", "driver_version", "memory_total", "max_memory_clock", "pcie_gen_max")
    return {"gpus": [dict(zip(fields, (v.strip() for v in row.split(",")))) for row in rows], "cuda_version": cuda}


def device_report() -> dict[str, Any]:
    """The JSON of ``device.json``: platform, devices (kind, memory where the runtime says),
    versions, nvidia-smi, the XLA/CUDA environment variables set, and JAX's report."""
    devices = []
    for d in jax.devices():
        entry: dict[str, Any] = {"id": d.id, "platform": d.platform, "kind": d.device_kind}
        try:
            stats = d.memory_stats() or {}
        except (NotImplementedError, RuntimeError, jax.errors.JaxRuntimeError):
            stats = {}
        if "bytes_limit" in stats:
            entry["bytes_limit"] = int(stats["bytes_limit"])
        devices.append(entry)
    try:
        environment = jax.print_environment_info(return_string=True)
    except Exception as err:  # noqa: BLE001  a report of the report's failure is still a report
        environment = f"print_environment_info failed: {type(err).__name__}: {err}"
    env = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "CUDA_", "TF_CPP", "LIBTPU", "TPU_"))}
    return {
        "backend": jax.default_backend(),
        "devices": devices,
        "versions": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "nvidia_smi": nvidia_smi(),
        "environment_variables": env,
        "jax_environment": environment,
    }
