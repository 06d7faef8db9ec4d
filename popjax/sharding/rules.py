"""The logical axes and the one rules table: every parameter, KV cache and method-state leaf names
its dimensions with logical axes (a parameter declares them where the model creates it: ``axes``
metadata, models/layers.py); ``RULES`` maps each to a mesh axis or to None (replicated)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from flax import nnx
from jax.sharding import PartitionSpec

from ..models.config import ModelConfig
from ..models.decoder import abstract_model
from ..models.scan import abstract_scanned_model

MESH_AXES = ("data", "model")

# Logical axis -> mesh axis (None: replicated). The one place that decides what is split where.
RULES: dict[str, str | None] = {
    "batch": "data",  # rows of a batch (KV caches, per-sequence method states, tokens)
    "cache_len": None,  # cache slots
    "vocab": "model",  # embedding / LM-head rows
    "embed": None,  # the hidden size d
    "heads": "model",  # query heads (o's input columns)
    "kv_heads": "model",  # KV heads of the caches
    "head_dim": None,
    "qkv_part": None,  # qkv's [g + 2] axis (a KV group's query heads, key, value): all on the group's device
    "mlp": "model",  # FFN channels (down's columns, ‖W_d[:, j]‖₂)
    "mlp_pair": None,  # the [2] (gate, up) axis of gate_up: both halves on every device
    "mlp_shard": "model",  # the [n_shards] axis of POP's per-shard partition state
    "norm": None,  # RMSNorm scales
    "experts": None,  # a MoE layer's expert blocks: replicated; each expert's channels split over "model"
    "layers": None,  # the stacked layer axis of a scanned model (models/scan.py): every device holds every layer
}

CACHE_AXES = ("batch", "cache_len", "kv_heads", "head_dim")  # k, v [B, S, n_kv, h]


def declared_axes(state: nnx.State) -> dict[str, tuple[str | None, ...]]:
    """Dotted path -> the logical axes each variable of ``state`` declares (``axes`` metadata, set
    where the model creates the parameter: models/layers.py, models/moe.py, models/scan.py)."""
    return {".".join(str(k) for k in path): tuple(v.get_metadata()["axes"]) for path, v in nnx.to_flat_state(state)}


def model_axes(cfg: ModelConfig, scan_layers: bool = False) -> dict[str, tuple[str | None, ...]]:
    """Every parameter path of the model of ``cfg`` (unrolled, or scanned: ``layer_stack.*``) ->
    its declared logical axes, read from the shape-only model (nothing allocated; cached per
    config, keyed by its repr: some configs hold lists, so they are not hashable)."""
    return _model_axes(repr(cfg), cfg, scan_layers)


_AXES_CACHE: dict[tuple[str, bool], dict[str, tuple[str | None, ...]]] = {}


def _model_axes(key: str, cfg: ModelConfig, scan_layers: bool) -> dict[str, tuple[str | None, ...]]:
    if (key, scan_layers) not in _AXES_CACHE:
        build = abstract_scanned_model if scan_layers else abstract_model
        _AXES_CACHE[(key, scan_layers)] = declared_axes(nnx.split(build(cfg))[1])
    return _AXES_CACHE[(key, scan_layers)]


def param_axes(path: str, cfg: ModelConfig) -> tuple[str | None, ...]:
    """Logical axes of the parameter at ``path`` of the model of ``cfg`` (e.g. ``layers.3.mlp.down``;
    ``layer_stack.*`` in the scanned model), as the model declares them."""
    table = model_axes(cfg, path.startswith("layer_stack."))
    if path not in table:
        raise ValueError(f"parameter {path!r} has no logical axes: the {cfg.model_type} model declares no such "
                         f"parameter (it has e.g. {sorted(table)[:6]})")
    return table[path]


def partition_spec(axes: tuple[str | None, ...], mesh_axes: Mapping[str, int] | None = None,
                   rules: Mapping[str, str | None] = RULES) -> PartitionSpec:
    """Logical axes -> PartitionSpec under ``rules``; mesh axes absent from ``mesh_axes`` (or of
    size 1) are dropped, so one rule set serves every mesh."""
    out = []
    for axis in axes:
        if axis is not None and axis not in rules:
            raise ValueError(f"unknown logical axis {axis!r}; valid axes: {sorted(rules)}")
        target = None if axis is None else rules[axis]
        if target is not None and mesh_axes is not None and mesh_axes.get(target, 1) == 1:
            target = None
        out.append(target)
    return PartitionSpec(*out)


def param_paths(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) of every leaf of a pure-dict params tree (``nnx.to_pure_dict``), in the
    form `param_axes` reads (e.g. ``layers.3.mlp.down``)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from param_paths(value, name + ".")
        else:
            yield name, value


def map_paths(fn, tree: Mapping, prefix: str = "") -> dict:
    return {k: map_paths(fn, v, f"{prefix}{k}.") if isinstance(v, Mapping) else fn(f"{prefix}{k}", v)
            for k, v in tree.items()}
