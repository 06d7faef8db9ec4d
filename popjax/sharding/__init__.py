"""Scale-out, one module per job (rules, mesh, params, gathers, hlo): logical axes for every array, one rules table mapping them to a device mesh.

Every parameter, KV cache and method-state leaf names its dimensions with *logical* axes
(``vocab``, ``embed``, ``mlp`` ...); a parameter declares them where the model creates it
(``axes`` metadata, models/layers.py), and `model_axes` reads them back from the shape-only model. ``RULES`` maps each logical axis to a mesh axis (``"data"``
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
weight it comes from. Candidate rows that every step gathers a few of (POP's) are copied whole to
every device by ``take_replicated``: local gathers and one all-reduce of the copy.

Mesh axes: ``data`` (batch) × ``model`` (heads, FFN channels, vocabulary).
"""

from __future__ import annotations

from .rules import declared_axes, model_axes, param_axes, partition_spec, param_paths, MESH_AXES, RULES, CACHE_AXES
from .mesh import make_mesh, check_mesh, check_batch, use_mesh, active_mesh_axes, constrain, constrain_cache, constrain_method_state
from .params import param_sharding, param_shardings, abstract_params, place, shard_params
from .gathers import split_channels, take_split, take_replicated, take_split_rows, pad_ids, UNOWNED
from .hlo import count_collectives, collective_operands, COLLECTIVES

__all__ = [
    "declared_axes",
    "model_axes",
    "param_axes",
    "partition_spec",
    "param_paths",
    "MESH_AXES",
    "RULES",
    "CACHE_AXES",
    "make_mesh",
    "check_mesh",
    "check_batch",
    "use_mesh",
    "active_mesh_axes",
    "constrain",
    "constrain_cache",
    "constrain_method_state",
    "param_sharding",
    "param_shardings",
    "abstract_params",
    "place",
    "shard_params",
    "split_channels",
    "take_split",
    "take_replicated",
    "take_split_rows",
    "pad_ids",
    "UNOWNED",
    "count_collectives",
    "collective_operands",
    "COLLECTIVES",
]
