"""Where parameters live on a mesh: each parameter's sharding from its declared axes, abstract
sharded shapes for ahead-of-time compiles (no weights allocated), and placing host arrays or a
loaded model straight into their shardings."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from ..models.config import ModelConfig
from ..models.decoder import abstract_model
from ..models.scan import abstract_scanned_model
from .mesh import check_mesh
from .rules import map_paths, param_axes, partition_spec

def param_sharding(path: str, shape: tuple[int, ...], mesh: Mesh, cfg: ModelConfig) -> NamedSharding:
    """The sharding of one parameter of the model of ``cfg``; checks that every split dimension
    divides evenly."""
    axes = param_axes(path, cfg)
    if len(axes) != len(shape):
        raise ValueError(f"parameter {path!r} has shape {shape}; its logical axes {axes} need rank {len(axes)}")
    spec = partition_spec(axes, dict(mesh.shape))
    for dim, (size, target) in enumerate(zip(shape, spec)):
        if target is not None and size % mesh.shape[target]:
            raise ValueError(f"parameter {path!r} dimension {dim} ({axes[dim]}) of size {size} is not divisible "
                             f"by the mesh's {target} axis of size {mesh.shape[target]}")
    return NamedSharding(mesh, spec)


def param_shardings(params: Any, mesh: Mesh, cfg: ModelConfig) -> dict:
    """A pure-dict params tree (``nnx.to_pure_dict``) -> the same tree of NamedShardings."""
    return map_paths(lambda path, leaf: param_sharding(path, tuple(leaf.shape), mesh, cfg), params)


def abstract_params(cfg: ModelConfig, mesh: Mesh, dtype: str = "float32", scan_layers: bool = False) -> Any:
    """The model's params as ShapeDtypeStructs carrying their shardings (an ``nnx.State``): what
    an ahead-of-time ``jit(...).lower`` needs to plan per-device memory without any weights.
    ``scan_layers``: the scanned model's params (``layer_stack.*`` [L, ...], models/scan.py; a
    ValueError for configs it refuses, e.g. per-layer widths)."""
    check_mesh(cfg, mesh)
    build = abstract_scanned_model if scan_layers else abstract_model
    _, state = nnx.split(build(cfg, jnp.dtype(dtype)))
    pure = nnx.to_pure_dict(state)
    shaped = map_paths(
        lambda path, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param_sharding(path, tuple(leaf.shape), mesh, cfg)),
        pure,
    )
    nnx.replace_by_pure_dict(state, shaped)
    return state


def place(path: str, array: np.ndarray, dtype, mesh: Mesh, cfg: ModelConfig) -> jax.Array:
    """Host array -> device array in its sharding: each device receives only its own block
    (``jax.device_put`` slices on the host), no full copy on one device first."""
    return jax.device_put(np.asarray(array, dtype=dtype), param_sharding(path, tuple(array.shape), mesh, cfg))


def shard_params(model: Any, mesh: Mesh) -> Any:
    """A loaded model (popjax.loaded.LoadedModel) with every parameter placed in its sharding on
    ``mesh`` (and ``mesh`` set, so generate/forward run under it)."""
    check_mesh(model.config, mesh)
    pure = nnx.to_pure_dict(model.params)
    placed = map_paths(lambda path, leaf: jax.device_put(leaf, param_sharding(path, tuple(leaf.shape), mesh, model.config)), pure)
    state = jax.tree_util.tree_map(lambda x: x, model.params)  # a copy: the input model stays valid
    nnx.replace_by_pure_dict(state, placed)
    return dataclasses.replace(model, params=state, mesh=mesh)
