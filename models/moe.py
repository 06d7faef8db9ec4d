"""Mixture-of-experts FFN blocks: Qwen2-MoE, Qwen3-MoE and Mixtral (see docs/moe.md).

Every FFN of a MoE model is stored as a stack of *blocks* of the expert width ``f_e``:

* ``experts``  [E] routed experts: ``gate_up [E, 2, f_e, d]`` (gate and up stacked),
  ``down [E, d, f_e]``, ``down_norm [E, f_e]`` (‖W_d[:, j]‖₂, derived);
* ``shared``   [n_s] always-active blocks: Qwen2-MoE's shared expert (width ``f_s``) split into
  ``n_s = ⌈f_s / f_e⌉`` blocks of f_e channels (the last zero-padded), or the whole FFN of a dense
  layer (``mlp_only_layers`` / ``decoder_sparse_step``) split the same way.

Splitting an FFN into channel blocks is exact (its output is a sum over channels), and it lets one
bound plan (``Method.bind`` sees one FFN width, ``ModelConfig.intermediate_size = f_e``) prune every
FFN of the model with the same per-expert budget. Each block gets its own method state, stacked on
a leading block axis, through ``jax.vmap`` (no Python loop over experts at run time).

Channels of every block are stored sorted by a weight-only score (``channel_order`` maps stored
positions back to HF channel ids), so a prompt-scored method's ranking of a block that no prompt
token reached (all scores zero; ties go to the lower id) is the weight-only ranking.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .moe_config import MoEConfig  # noqa: F401 (re-exported: the MoE config beside its layers)
from .interface import FFNFn, FFNWeights
from .layers import Derived, LinearWeights, linear
from ..kernels.int8 import dequantized

# ---------------------------------------------------------------- weights


class ExpertStack(nnx.Module, LinearWeights):
    """n FFN blocks of width f: gate_up [n, 2, f, d], down [n, d, f] (float, or int8 with
    per-output-channel scales: ``weights`` "int8"), down_norm [n, f] (derived), channel_order
    [n, f] (HF channel id of each stored channel; -1 for zero padding)."""

    def __init__(self, n: int, f: int, d: int, dtype: jnp.dtype, weights: str = "float", activations: str = "float",
                 act: str = "silu"):
        self.act = act  # the gate activation's name, static (`FFNWeights.act`)
        # the blocks replicated ("experts"), each block's channels split like a dense FFN's
        self._linear_param("gate_up", (n, 2, f, d), dtype, weights, activations, ("experts", "mlp_pair", "mlp", "embed"))
        self._linear_param("down", (n, d, f), dtype, weights, activations, ("experts", "embed", "mlp"))
        self.down_norm = Derived(jnp.zeros((n, f), jnp.float32), axes=("experts", "mlp"))
        self.channel_order = Derived(jnp.zeros((n, f), jnp.int32), axes=("experts", "mlp"))

    def finalize(self) -> None:
        down = dequantized(self.weight("down")).astype(jnp.float32)
        self.down_norm[...] = jnp.sqrt(jnp.sum(down * down, axis=1))

    def ffn_weights(self, first_slot: int) -> FFNWeights:
        """The n blocks as one `FFNWeights` with a leading [n] axis on every array (``block``:
        their slots, `MoEConfig.slots`, from ``first_slot``), for a vmap over blocks; ``layer``
        is set per call."""
        n = self.down_norm.shape[0]
        return FFNWeights(self.weight("gate_up"), self.weight("down"), self.down_norm[...], None,
                          block=first_slot + jnp.arange(n, dtype=jnp.int32), act=self.act)


class MoEWeights(nnx.Module):
    """One layer's FFN in a MoE model: router [E, d] and routed ``experts`` (sparse layers),
    ``shared`` always-active blocks and ``shared_gate`` [1, d] (Qwen2-MoE)."""

    def __init__(self, cfg, dtype: jnp.dtype, layer: int):
        moe, d = cfg.moe, cfg.hidden_size
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.n_experts = moe.num_experts  # slot offset of the always-active blocks (MoEConfig.slots)
        if moe.is_sparse(layer):
            self.router = nnx.Param(jnp.zeros((moe.num_experts, d), dtype), axes=("experts", "embed"))
            self.experts = ExpertStack(moe.num_experts, moe.expert_size, d, dtype, cfg.weights, cfg.activations, cfg.hidden_act)
        n_always = moe.blocks(moe.always_width(layer))
        if n_always:
            self.shared = ExpertStack(n_always, moe.expert_size, d, dtype, cfg.weights, cfg.activations, cfg.hidden_act)
            if moe.is_sparse(layer) and moe.shared_gate:
                self.shared_gate = nnx.Param(jnp.zeros((1, d), dtype), axes=(None, "embed"))

    def finalize(self) -> None:
        for name in ("experts", "shared"):
            if hasattr(self, name):
                getattr(self, name).finalize()


def checkpoint_shapes(cfg, layer: int) -> dict[str, tuple[int, ...]]:
    """Converted-checkpoint shapes (HF [out, in] layout, one entry per source tensor) of one
    layer's MoE FFN, paths relative to ``layers.{layer}.mlp.``."""
    moe, d, f = cfg.moe, cfg.hidden_size, cfg.moe.expert_size
    if not moe.is_sparse(layer):
        w = moe.dense_size
        return {"gate": (w, d), "up": (w, d), "down": (d, w)}
    shapes = {"router": (moe.num_experts, d)}
    for e in range(moe.num_experts):
        shapes.update({f"experts.{e}.gate": (f, d), f"experts.{e}.up": (f, d), f"experts.{e}.down": (d, f)})
    if moe.shared_size:
        s = moe.shared_size
        shapes.update({"shared.gate": (s, d), "shared.up": (s, d), "shared.down": (d, s)})
        if moe.shared_gate:
            shapes["shared_gate"] = (1, d)
    return shapes


def weight_only_score(gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """‖W_g[j]‖₂ · ‖W_u[j]‖₂ · ‖W_d[:, j]‖₂ per channel ([f, d], [f, d], [d, f] -> [f] float64):
    the scale of |H_j|·‖W_d[:, j]‖₂ for an input of unit-scale features, without any input."""
    norm = lambda a, axis: np.sqrt(np.sum(np.asarray(a, np.float64) ** 2, axis=axis))
    return norm(gate, 1) * norm(up, 1) * norm(down, 0)


def stack_blocks(gate: np.ndarray, up: np.ndarray, down: np.ndarray, f: int) -> dict[str, np.ndarray]:
    """One FFN ([w, d], [w, d], [d, w]) -> ⌈w/f⌉ blocks of f channels, each sorted by decreasing
    weight-only score (ties: lower HF id first; zero padding last):
    {"gate_up": [n, 2, f, d], "down": [n, d, f], "channel_order": [n, f] int32 (-1 = padding)}."""
    w, d = gate.shape
    n = math.ceil(w / f)
    pad = n * f - w
    ids = np.concatenate([np.arange(w), -np.ones(pad, np.int64)]).reshape(n, f)
    gate = np.concatenate([gate, np.zeros((pad, d), gate.dtype)]).reshape(n, f, d)
    up = np.concatenate([up, np.zeros((pad, d), up.dtype)]).reshape(n, f, d)
    down = np.concatenate([down, np.zeros((d, pad), down.dtype)], axis=1).reshape(d, n, f).transpose(1, 0, 2)
    out = {"gate_up": [], "down": [], "channel_order": []}
    for b in range(n):
        score = weight_only_score(gate[b], up[b], down[b])
        order = np.lexsort((np.arange(f), -score))  # decreasing score, then increasing position
        out["gate_up"].append(np.stack([gate[b][order], up[b][order]]))
        out["down"].append(down[b][:, order])
        out["channel_order"].append(ids[b][order])
    return {k: np.stack(v).astype(np.int32 if k == "channel_order" else gate.dtype) for k, v in out.items()}


def fuse_layer(cfg, layer: int, mlp: Mapping[str, Any]) -> dict[str, Any]:
    """Converted tree of one layer's FFN (HF layout, see `checkpoint_shapes`) -> MoEWeights tree."""
    f = cfg.moe.expert_size
    if not cfg.moe.is_sparse(layer):
        return {"shared": stack_blocks(mlp["gate"], mlp["up"], mlp["down"], f)}
    experts = [mlp["experts"][str(e)] for e in range(cfg.moe.num_experts)]
    blocks = [stack_blocks(e["gate"], e["up"], e["down"], f) for e in experts]
    out = {"router": mlp["router"], "experts": {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}}
    if "shared" in mlp:
        out["shared"] = stack_blocks(mlp["shared"]["gate"], mlp["shared"]["up"], mlp["shared"]["down"], f)
    if "shared_gate" in mlp:
        out["shared_gate"] = mlp["shared_gate"]
    return out


def slot_array(cfg, layer: int, mlp: Mapping[str, Any], name: str) -> np.ndarray:
    """One layer's per-block weight ``name`` ("gate_up", "down", ...) by slot (`MoEConfig.slots`):
    ``mlp`` is the layer's pure param dict -> [slots, ...] (zeros in slots without a block)."""
    moe = cfg.moe
    parts = [(0, mlp.get("experts")), (moe.num_experts, mlp.get("shared"))]
    sample = next(np.asarray(p[name]) for _, p in parts if p is not None)
    out = np.zeros((moe.slots(cfg.num_hidden_layers), *sample.shape[1:]), sample.dtype)
    for offset, part in parts:
        if part is not None:
            block = np.asarray(part[name])
            out[offset : offset + block.shape[0]] = block
    return out


def table_row(w: FFNWeights, slots: int) -> jax.Array:
    """The row of ``w``'s block in a per-block constant table flattened to [L · slots] rows
    (``slots`` = 0: a dense model's per-layer table, row = layer)."""
    return w.layer * slots + w.block if slots else w.layer


# ---------------------------------------------------------------- forward

def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """HF top-k routing: softmax over all E logits in fp32, the top k, optionally renormalised
    (Mixtral always: = softmax over the top-k logits). x [B, T, d], router [E, d] ->
    (weights [B, T, k] in x's dtype, expert ids [B, T, k] int32)."""
    probs = jax.nn.softmax(linear(x, router).astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32)


def _run(fn: FFNFn, stack: FFNWeights, layer, state, x, valid, routed=None):
    """The method on every block of a stack through vmap: (y [n, B, T, d], state [n, ...], aux [n, ...]).
    ``routed`` [n, B, T] (routed experts) narrows ``valid`` [B, T] to each block's tokens. Each
    block's weights carry ``layer`` and ``block`` (its slot, `MoEConfig.slots`), so methods with
    calibrated per-block constants index them by ``[layer, block]`` (`table_row`)."""

    def one(w, s, r):
        return fn(w.replace(layer=layer), s, x, valid if r is None else valid & r)

    return jax.vmap(one)(stack, state, routed)


def _keeps_state_shape(fn: FFNFn, stack: FFNWeights, layer, state, x, valid) -> bool:
    """Whether the method returns a state shaped like the one it got (decode), as opposed to
    building one (prefill, or a boundary step that prefills one token): only then may a step run
    on a subset of the experts and leave the others' states as they are."""
    one = lambda a: a[0]
    out = jax.eval_shape(
        lambda w, s: fn(w.replace(layer=layer), s, x, valid),
        jax.tree_util.tree_map(one, stack), jax.tree_util.tree_map(one, state),
    )[1]
    given = [(a.shape[1:], a.dtype) for a in jax.tree_util.tree_leaves(state)]
    returned = [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(out)]
    return jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(out) and given == returned


def _routed_experts(fn: FFNFn, stack: FFNWeights, layer, state, x, valid, weights, ids, n_experts: int, dispatch: str):
    """The routed experts -> (y [B, T, d], state [E, ...], aux [E, ...]).

    "dense": every expert runs on every token with ``routed`` marking its tokens, combined with
    the router weights (0 for the unrouted). "gather" (decode): only the U = min(E, B·T·k)
    distinct experts the step routed to run; their states are gathered and written back, and a
    leaf the method returned unchanged (e.g. a partition fixed at prefill) is not written at all."""
    one_hot = ids[..., None] == jnp.arange(n_experts)  # [B, T, k, E]
    if dispatch == "dense":
        routed = jnp.moveaxis(jnp.any(one_hot, axis=-2), -1, 0)  # [E, B, T]
        y, state, aux = _run(fn, stack, layer, state, x, valid, routed)
        combine = jnp.sum(jnp.where(one_hot, weights[..., None], 0), axis=-2)  # [B, T, E]
        return jnp.einsum("ebtd,bte->btd", y, combine.astype(y.dtype)), state, aux
    slots = min(n_experts, ids.size)
    chosen = jnp.unique(ids.reshape(-1), size=slots, fill_value=n_experts)  # [U]; E marks an empty slot
    hits = ids[..., None] == chosen  # [B, T, k, U]
    routed = jnp.moveaxis(jnp.any(hits, axis=-2), -1, 0)  # [U, B, T]
    take = lambda a: jnp.take(a, chosen, axis=0, mode="clip")
    sub_state = jax.tree_util.tree_map(take, state)
    y, new_state, aux = _run(fn, jax.tree_util.tree_map(take, stack), layer, sub_state, x, valid, routed)
    combine = jnp.sum(jnp.where(hits, weights[..., None], 0), axis=-2)  # [B, T, U]
    write = lambda full, old, new: full if new is old else full.at[chosen].set(new, mode="drop")
    state = jax.tree_util.tree_map(write, state, sub_state, new_state)
    scatter = lambda a: jnp.zeros((n_experts, *a.shape[1:]), a.dtype).at[chosen].set(a, mode="drop")
    return jnp.einsum("ubtd,btu->btd", y, combine.astype(y.dtype)), state, jax.tree_util.tree_map(scatter, aux)


def moe_mlp(mlp: MoEWeights, fn: FFNFn, state: Any, x: jax.Array, valid: jax.Array, layer: jax.Array, dispatch: str = "auto"):
    """One layer's MoE FFN under the method's ``fn`` -> (y [B, T, d], state, aux); ``valid`` [B, T]
    the tokens the method's statistics may use (each expert: those routed to it).

    ``state`` is None (prefill) or {"experts": [E, ...], "shared": [n_s, ...]}. ``aux`` holds the
    method's aux per block ("experts" [E, ...], "shared" [n_s, ...]) and the router's choices
    ("router_topk" [B, T, k]). ``dispatch`` "auto" gathers the routed experts in a decode step
    (T = 1) when fewer than E are routed, and runs all experts densely otherwise."""
    state = {} if state is None else state
    new_state, aux = {}, {}
    y = jnp.zeros_like(x)
    if hasattr(mlp, "router"):
        weights, ids = route(x, mlp.router[...], mlp.top_k, mlp.norm_topk_prob)
        n_experts = mlp.router.shape[0]
        stack = mlp.experts.ffn_weights(0)
        expert_state = state.get("experts")
        mode = dispatch
        if mode == "auto":
            mode = "dense"
            if x.shape[1] == 1 and ids.size < n_experts:
                mode = "gather" if _keeps_state_shape(fn, stack, layer, expert_state, x, valid) else "dense"
        y_e, new_state["experts"], aux["experts"] = _routed_experts(
            fn, stack, layer, expert_state, x, valid, weights, ids, n_experts, mode
        )
        y = y + y_e
        aux["router_topk"] = ids
    if hasattr(mlp, "shared"):
        shared = mlp.shared.ffn_weights(mlp.n_experts)
        y_s, new_state["shared"], aux["shared"] = _run(fn, shared, layer, state.get("shared"), x, valid)
        y_s = jnp.sum(y_s, axis=0)
        if hasattr(mlp, "shared_gate"):
            y_s = jax.nn.sigmoid(linear(x, mlp.shared_gate[...])) * y_s
        y = y + y_s
    return y, new_state, aux
