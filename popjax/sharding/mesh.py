"""The device mesh (``data`` × ``model``), its checks against a model and a batch, the context a
sharded model runs under, and sharding hints for the arrays the engine creates (caches, states)."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..kernels.int8 import Int8Weight
from ..models.config import ModelConfig
from .rules import CACHE_AXES, MESH_AXES, RULES, partition_spec

def make_mesh(shape: tuple[int, int] = (1, -1), devices: list | None = None) -> Mesh:
    """A ``("data", "model")`` mesh over the first data·model devices; -1 takes the rest.

    ``make_mesh((1, 8))``: 8-way tensor parallel; ``make_mesh((2, 4))``: 2 data × 4 model."""
    devices = list(jax.devices() if devices is None else devices)
    if len(shape) != 2 or any(not isinstance(s, int) or isinstance(s, bool) for s in shape):
        raise ValueError(f"mesh shape {shape!r} must be two integers (data, model)")
    data, model = shape
    if data == -1 and model == -1 or min(data, model) < -1 or 0 in shape:
        raise ValueError(f"mesh shape {shape!r}: give positive sizes (at most one -1)")
    if -1 in shape:
        known = model if data == -1 else data
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape!r}: {len(devices)} devices are not divisible by {known}")
        data, model = (len(devices) // known, known) if data == -1 else (known, len(devices) // known)
    if data * model > len(devices):
        raise ValueError(
            f"mesh shape ({data}, {model}) needs {data * model} devices; {len(devices)} available "
            "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices)"
        )
    grid = np.array(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def check_mesh(cfg: ModelConfig, mesh) -> None:
    """Raises ValueError when the mesh cannot split the model evenly (names the value)."""
    sizes = dict(mesh.shape)
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh axes {unknown} are unknown; popjax meshes have axes {MESH_AXES} (use make_mesh)")
    n = sizes.get("model", 1)
    widths = sorted(set(cfg.intermediate_sizes or (cfg.intermediate_size,)))
    checks = [
        ("num_attention_heads", cfg.num_attention_heads, "heads"),
        ("num_key_value_heads", cfg.num_key_value_heads, "kv_heads"),
        ("vocab_size", cfg.vocab_size, "vocab"),
        *(("intermediate_size", f, "mlp") for f in widths),
    ]
    for name, value, axis in checks:
        if RULES[axis] == "model" and value % n:
            valid = [k for k in range(1, value + 1) if value % k == 0]
            raise ValueError(
                f"the mesh's model axis of size {n} does not divide {name}={value}; "
                f"valid model-axis sizes for this model divide it: {valid}"
            )


def check_batch(rows: int, mesh) -> None:
    data = dict(mesh.shape).get("data", 1)
    if rows % data:
        raise ValueError(f"a batch of {rows} rows cannot be split over the mesh's data axis of size {data}; "
                         f"use a batch size that is a multiple of {data}")


def use_mesh(model: Any) -> contextlib.AbstractContextManager:
    """The context generate/forward run under: ``jax.set_mesh(model.mesh)``, or nothing for an
    unsharded model (its compiled programs are then exactly the single-device ones)."""
    mesh = getattr(model, "mesh", None)
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def active_mesh_axes() -> dict[str, int]:
    """Axis sizes of the mesh set by ``use_mesh`` (empty without one); usable while tracing."""
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else dict(mesh.shape)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """``with_sharding_constraint`` by logical axes when a mesh is active; x unchanged otherwise.
    Dimensions that the mesh axis does not divide are left replicated (a hint, never an error)."""
    sizes = active_mesh_axes()
    if not sizes:
        return x
    if isinstance(x, Int8Weight):  # values and scales alike (a scale's size-1 input axis stays replicated)
        return jax.tree_util.tree_map(lambda a: constrain(a, axes), x)
    spec = list(partition_spec(axes, sizes))
    spec = [t if t is None or x.shape[i] % sizes[t] == 0 else None for i, t in enumerate(spec)]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def constrain_cache(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """KV cache k, v [..., B, S, n_kv, h] (a scanned model's caches lead with [L]) -> constrained
    to (batch, cache_len, kv_heads, head_dim), leading axes replicated."""
    axes = (None,) * (k.ndim - len(CACHE_AXES)) + CACHE_AXES
    return constrain(k, axes), constrain(v, axes)


def constrain_method_state(plan: Any, state: Any) -> Any:
    """A method state: per-sequence states (``plan.state_per_sequence``: a leading batch axis on
    every leaf) are split over ``data`` like the batch; other states keep the shardings their
    own code asks for."""
    if not active_mesh_axes() or state is None or not plan.state_per_sequence:
        return state
    sizes = active_mesh_axes()
    data = RULES["batch"] if sizes.get(RULES["batch"], 1) > 1 else None

    def rows(a):  # the batch axis over "data"; other axes keep what the method's own code asked for
        if not a.ndim or data is None or a.shape[0] % sizes[data]:
            return a
        return jax.lax.with_sharding_constraint(a, PartitionSpec(data, *[PartitionSpec.UNCONSTRAINED] * (a.ndim - 1)))

    return jax.tree_util.tree_map(rows, state)
