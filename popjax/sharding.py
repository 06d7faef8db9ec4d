"""Scale-out: logical axes for every array, one rules table mapping them to a device mesh.

Every parameter, KV cache and method-state leaf names its dimensions with *logical* axes
(``vocab``, ``embed``, ``mlp`` ...). ``RULES`` maps each logical axis to a mesh axis (``"data"``
or ``"model"``) or to ``None`` (replicated). The same table gives the shardings of a loaded model
(``shard_params``, ``popjax.load(mesh=...)``), of abstract shapes for ahead-of-time compiles
(``abstract_params``: what a memory plan lowers against, no weights allocated), and of the
caches and states the engine creates (``constrain``, a no-op without an active mesh, so the
single-device path compiles exactly as before).

Fused arrays. ``mlp.gate_up`` is gate and up stacked on a leading axis, ``[2, f, d]``, split on
f: every device holds the gate *and* up rows of the same f/n channels, so the SwiGLU product
and every channel gather stay local (every method reads this layout; base.activations). POP's
``partition="per_shard"`` gathers through a ``[2, n, f/n, d]`` view whose blocks are exactly the
devices' blocks. ``attn.qkv`` is grouped by KV head, ``[n_kv, g + 2, h, d]`` (models/layers.py),
split on n_kv: every device holds the query, key and value heads of its own KV groups, the
cache's heads and o's columns of the same groups, so attention runs without communication.
Compact copies of channels that lie anywhere in f (static, global POP) are made by
``take_split``: local gathers and one reduce-scatter, the copy split over ``model`` like the
weight it comes from.

Mesh axes: ``data`` (batch) × ``model`` (heads, FFN channels, vocabulary).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .models.config import ModelConfig
from .models.decoder import abstract_model
from .models.scan import abstract_scanned_model
from .models.quant import Int8Weight

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

# Parameter path (dots, layer index as \d+) -> logical axes of its dimensions.
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"embed", ("vocab", "embed")),
    (r"lm_head", ("vocab", "embed")),
    (r"(embed|lm_head)_scale", ("vocab", None)),  # an int8 model's per-token-row scales
    (r"final_norm\.weight", ("norm",)),
    (r"layers\.\d+\.(attn_norm|mlp_norm|attn_post_norm|mlp_post_norm)\.weight", ("norm",)),
    (r"layers\.\d+\.attn\.qkv", ("kv_heads", "qkv_part", "head_dim", "embed")),
    (r"layers\.\d+\.attn\.qkv_bias", ("kv_heads", "qkv_part", "head_dim")),
    # an int8 model's per-output-channel scales (models/quant.py): the weight's axes, 1 on its input axis
    (r"layers\.\d+\.attn\.qkv_scale", ("kv_heads", "qkv_part", "head_dim", None)),
    (r"layers\.\d+\.attn\.o_scale", ("embed", None)),
    (r"layers\.\d+\.mlp\.gate_up_scale", ("mlp_pair", "mlp", None)),
    (r"layers\.\d+\.mlp\.down_scale", ("embed", None)),
    (r"layers\.\d+\.mlp\.(experts|shared)\.gate_up_scale", ("experts", "mlp_pair", "mlp", None)),
    (r"layers\.\d+\.mlp\.(experts|shared)\.down_scale", ("experts", "embed", None)),
    (r"layers\.\d+\.attn\.o", ("embed", "heads")),
    (r"layers\.\d+\.attn\.(q_norm|k_norm)\.weight", ("head_dim",)),
    (r"layers\.\d+\.mlp\.gate_up", ("mlp_pair", "mlp", "embed")),
    (r"layers\.\d+\.mlp\.down", ("embed", "mlp")),
    (r"layers\.\d+\.mlp\.down_norm", ("mlp",)),
    (r"layers\.\d+\.mlp\.down_bias", ("embed",)),
    # MoE layers (models/moe.py): expert stacks [E, ...] of the routed and the shared experts
    (r"layers\.\d+\.mlp\.router", ("experts", "embed")),
    (r"layers\.\d+\.mlp\.shared_gate", (None, "embed")),
    (r"layers\.\d+\.mlp\.(experts|shared)\.gate_up", ("experts", "mlp_pair", "mlp", "embed")),
    (r"layers\.\d+\.mlp\.(experts|shared)\.down", ("experts", "embed", "mlp")),
    (r"layers\.\d+\.mlp\.(experts|shared)\.(down_norm|channel_order)", ("experts", "mlp")),
)
# A scanned model (models/scan.py) stacks every layer's parameter on a leading [L] axis under
# ``layer_stack.``: the same logical axes behind a "layers" axis.
PARAM_AXES += tuple(
    (pattern.replace(r"layers\.\d+\.", r"layer_stack\.", 1), ("layers", *axes))
    for pattern, axes in PARAM_AXES
    if pattern.startswith(r"layers\.\d+\.")
)
CACHE_AXES = ("batch", "cache_len", "kv_heads", "head_dim")  # k, v [B, S, n_kv, h]


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


def param_axes(path: str) -> tuple[str, ...]:
    """Logical axes of the parameter at ``path`` (e.g. ``layers.3.mlp.down``)."""
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, path):
            return axes
    raise ValueError(f"parameter {path!r} has no logical axes; known patterns: {[p for p, _ in PARAM_AXES]}")


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


def param_paths(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) of every leaf of a pure-dict params tree (``nnx.to_pure_dict``), in the
    form `param_axes` reads (e.g. ``layers.3.mlp.down``)."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from param_paths(value, name + ".")
        else:
            yield name, value


def _map_paths(fn, tree: Mapping, prefix: str = "") -> dict:
    return {k: _map_paths(fn, v, f"{prefix}{k}.") if isinstance(v, Mapping) else fn(f"{prefix}{k}", v)
            for k, v in tree.items()}


def param_sharding(path: str, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """The sharding of one parameter; checks that every split dimension divides evenly."""
    axes = param_axes(path)
    if len(axes) != len(shape):
        raise ValueError(f"parameter {path!r} has shape {shape}; its logical axes {axes} need rank {len(axes)}")
    spec = partition_spec(axes, dict(mesh.shape))
    for dim, (size, target) in enumerate(zip(shape, spec)):
        if target is not None and size % mesh.shape[target]:
            raise ValueError(f"parameter {path!r} dimension {dim} ({axes[dim]}) of size {size} is not divisible "
                             f"by the mesh's {target} axis of size {mesh.shape[target]}")
    return NamedSharding(mesh, spec)


def param_shardings(params: Any, mesh: Mesh) -> dict:
    """A pure-dict params tree (``nnx.to_pure_dict``) -> the same tree of NamedShardings."""
    return _map_paths(lambda path, leaf: param_sharding(path, tuple(leaf.shape), mesh), params)


def abstract_params(cfg: ModelConfig, mesh: Mesh, dtype: str = "float32", scan_layers: bool = False) -> Any:
    """The model's params as ShapeDtypeStructs carrying their shardings (an ``nnx.State``): what
    an ahead-of-time ``jit(...).lower`` needs to plan per-device memory without any weights.
    ``scan_layers``: the scanned model's params (``layer_stack.*`` [L, ...], models/scan.py; a
    ValueError for configs it refuses, e.g. per-layer widths)."""
    check_mesh(cfg, mesh)
    build = abstract_scanned_model if scan_layers else abstract_model
    _, state = nnx.split(build(cfg, jnp.dtype(dtype)))
    pure = nnx.to_pure_dict(state)
    shaped = _map_paths(
        lambda path, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param_sharding(path, tuple(leaf.shape), mesh)),
        pure,
    )
    nnx.replace_by_pure_dict(state, shaped)
    return state


def place(path: str, array: np.ndarray, dtype, mesh: Mesh) -> jax.Array:
    """Host array -> device array in its sharding: each device receives only its own block
    (``jax.device_put`` slices on the host), no full copy on one device first."""
    return jax.device_put(np.asarray(array, dtype=dtype), param_sharding(path, tuple(array.shape), mesh))


def shard_params(model: Any, mesh: Mesh) -> Any:
    """A loaded model (popjax.loaded.LoadedModel) with every parameter placed in its sharding on
    ``mesh`` (and ``mesh`` set, so generate/forward run under it)."""
    check_mesh(model.config, mesh)
    pure = nnx.to_pure_dict(model.params)
    placed = _map_paths(lambda path, leaf: jax.device_put(leaf, param_sharding(path, tuple(leaf.shape), mesh)), pure)
    state = jax.tree_util.tree_map(lambda x: x, model.params)  # a copy: the input model stays valid
    nnx.replace_by_pure_dict(state, placed)
    return dataclasses.replace(model, params=state, mesh=mesh)


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



# An id no device owns: gathers of it give zero rows (padding of split compact copies).
UNOWNED = -(2**30)


def split_channels() -> int:
    """How many ways a compact copy is split along its channel axis: the active mesh's ``mlp``
    axis size (FFN channels over ``model``), 1 without a mesh."""
    return active_mesh_axes().get(RULES["mlp"], 1)


def take_split(w: jax.Array, ids: jax.Array, axis: int) -> jax.Array:
    """``jnp.take(w, ids, axis)`` whose result is split over the ``mlp`` mesh axis along ``axis``,
    as ``w`` is, without ever gathering ``w``: each device takes the ids that fall in its own
    block of ``w`` (zeros for the others), and one reduce-scatter sums those partial copies, so
    each device keeps 1/n of the result. What static and global-partition POP copy at prefill:
    their kept channels lie anywhere in f, and XLA cannot keep a gather with prompt-dependent
    ids local to the channel shards (it replicates ``w``; docs/scale_out.md).

    w [..., F, ...] split in contiguous blocks along ``axis``; ids [k] (k a multiple of n; ids
    ``UNOWNED`` give zero rows) -> [..., k, ...]. Without a mesh (or n = 1): ``jnp.take``."""
    n = split_channels()
    if isinstance(w, Int8Weight):  # the int8 rows and, where it varies along ``axis``, their scales
        return w.along(axis, lambda a, ax: take_split(a, ids, ax))
    if n == 1:
        return jnp.take(w, ids, axis=axis, mode="clip")
    if w.shape[axis] % n or ids.shape[-1] % n:
        raise ValueError(f"take_split: axis {axis} of shape {w.shape} and {ids.shape[-1]} ids must divide by {n}")
    block = w.shape[axis] // n
    spec = PartitionSpec(*[RULES["mlp"] if i == axis else None for i in range(w.ndim)])

    def local(w_block, ids):
        position = ids - jax.lax.axis_index(RULES["mlp"]) * block
        mine = (position >= 0) & (position < block)
        rows = jnp.take(w_block, jnp.clip(position, 0, block - 1), axis=axis)
        rows = jnp.where(jnp.expand_dims(mine, tuple(i for i in range(w.ndim) if i != axis)), rows, 0)
        return jax.lax.psum_scatter(rows, RULES["mlp"], scatter_dimension=axis, tiled=True)

    return jax.shard_map(local, in_specs=(spec, PartitionSpec()), out_specs=spec)(w, ids)


def take_split_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of ``w`` [P, F, ...] read as its [P·F, ...] matrix, ids ``p·F + c`` [k] (k a multiple
    of n; negative ids give zero rows) -> [k, ...] split over the ``mlp`` mesh axis along rows,
    with ``w`` split along F: `take_split` for a block mixing parts, e.g. the gate rows of one
    channel set with the up rows of another out of ``gate_up`` [2, f, d] (gate-scored POP).
    Without a mesh: a gather from the free [P·F, ...] reshape. On a mesh: `take_split` of every
    part of the ids' channels (P× the rows, at prefill), then each row's part, elementwise."""
    P, F = w.shape[:2]
    if isinstance(w, Int8Weight):  # a scale per row: gathered like its row
        return Int8Weight(take_split_rows(w.values, ids), take_split_rows(w.scale, ids), w.dtype)
    if split_channels() == 1:
        return jnp.take(w.reshape(P * F, *w.shape[2:]), ids, axis=0, mode="clip")
    part = jnp.clip(ids // F, 0, P - 1)
    every_part = take_split(w, jnp.where(ids >= 0, ids - part * F, UNOWNED), axis=1)  # [P, k, ...]
    part = part.reshape(-1, *[1] * (w.ndim - 2))
    rows = every_part[0]
    for p in range(1, P):
        rows = jnp.where(part == p, every_part[p], rows)
    return rows


def pad_ids(ids: jax.Array) -> jax.Array:
    """ids [k] -> [k'] padded with ``UNOWNED`` to a multiple of `split_channels` (k' = k without a mesh)."""
    pad = -ids.shape[-1] % split_channels()
    return jnp.pad(ids, (0, pad), constant_values=UNOWNED) if pad else ids


COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Collective ops in compiled HLO text (``jit(f).lower(...).compile().as_text()``)."""
    return {op: len(re.findall(rf"= [^=]*? {op}(-start)?\(", hlo_text)) for op in COLLECTIVES}


def collective_operands(hlo_text: str, op: str) -> list[tuple[str, int]]:
    """(shape text, element count) of each ``op`` result in HLO text, largest first."""
    out = []
    for match in re.finditer(rf"= (\(?[a-z0-9]+\[[0-9,]*\][^=]*?) {op}(-start)?\(", hlo_text):
        dims = re.findall(r"\[([0-9,]*)\]", match.group(1))
        size = max((int(np.prod([int(d) for d in s.split(",") if d])) for s in dims), default=0)
        out.append((match.group(1)[:80], size))
    return sorted(out, key=lambda item: -item[1])
