"""Offline methods made ready for a config alone, so their programs compile without a model.

An offline method (TEAL, CATS, Wanda-sp, FLAP, GLASS, LaRoSa, principal TEAL, WINA, low-rank and
layer-band POP, block static in calibrated order, Prefill-Only with calibrated K/V) fits arrays on
a loaded model (``prepare``) and its compiled programs read them as a traced argument (``data``). A compile-only plan has no
weights and needs only their shapes: `shape_fitted` gives the method placeholder fits of the
right shapes (zeros, first-n channels, uniform drift) and `abstract_data` the data as
ShapeDtypeStructs. Large placeholders are NumPy broadcast views and the data is traced with
``jax.eval_shape``, so a 70B model's [L, d, d] rotations allocate nothing.

The placeholders' *values* never reach a compiled program; only static choices derived from them
would: Wanda-sp and FLAP keep n_keep channels in every layer (their real selections also sum to
L · n_keep; FLAP's per-layer widths may differ, which changes only the padded width n_max), and
layer-band POP gets uniform drift (every layer POP's band).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..methods import (CATS, FLAP, GLASS, TEAL, WINA, ColumnNorms, GlobalPrior, LayerBandsPOP, LaRoSa, LowRankPOP,
                       Method, PrefillOnly, PrincipalTEAL, Rotations, Thresholds, WandaSP)
from ..methods.base import block_rows
from ..methods.pop.low_rank import LowRankFactors
from ..methods.prefill_only.kv_calibration import KVCalibration
from ..methods.principal_teal import PrincipalFit
from ..methods.channel_order import BlockOrdered, ChannelOrder
from ..methods.wanda_sp import ChannelSelection
from ..loaded import check_uniform_ffn
from ..models.config import ModelConfig
from ..models.interface import FFNStack

SOURCE = "shape-only placeholder (popjax.analysis.shape_fitted)"


@dataclasses.dataclass(frozen=True)
class ShapeModel:
    """What ``Method.data(model)`` reads of a model, without weights: its config and dtype."""

    config: ModelConfig
    dtype: str
    mesh: Any = None  # none: shapes only

    def derived(self, name: str, build):
        """`LoadedModel.derived` without the memo: under ``jax.eval_shape`` nothing is built."""
        return build(self)

    def ffn_stack(self) -> FFNStack:
        """`LoadedModel.ffn_stack`'s shapes, as zeros (for ``jax.eval_shape``)."""
        cfg = self.config
        check_uniform_ffn(cfg)
        L, f, d = cfg.num_hidden_layers, cfg.intermediate_size, cfg.hidden_size
        if cfg.weights != "int8":
            return FFNStack(jnp.zeros((L, 2, f, d), self.dtype), jnp.zeros((L, d, f), self.dtype))
        return FFNStack(jnp.zeros((L, 2, f, d), jnp.int8), jnp.zeros((L, d, f), jnp.int8),
                        jnp.ones((L, 2, f, 1), jnp.float32), jnp.ones((L, d, 1), jnp.float32))


def _zeros(*shape: int) -> np.ndarray:
    """A read-only float32 array of ``shape`` that occupies one element (a broadcast view)."""
    return np.broadcast_to(np.zeros((), np.float32), shape)


def shape_fitted(method: Method, cfg: ModelConfig) -> Method:
    """``method`` holding placeholder fits for ``cfg`` where it is an offline method without
    them; every other method is returned as it is."""
    blocks, rows = block_rows(cfg)
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    if isinstance(method, PrefillOnly):
        inner = None if method.mlp_method is None else shape_fitted(method.mlp_method, cfg)
        method = dataclasses.replace(method, mlp_method=inner)
        if method.kv == "calibrated" and method.kv_calibration is None:
            skipped = method.skipped_layers(L)
            zeros = {l: _zeros(2 * cfg.kv_dim, d) for l in skipped}
            bias = {l: _zeros(2 * cfg.kv_dim) for l in skipped} if cfg.qkv_bias else {}
            method = dataclasses.replace(method, kv_calibration=KVCalibration(skipped, zeros, bias, {"source": SOURCE}, {}))
        return method
    targets = method.targets(cfg) if isinstance(method, (TEAL, CATS)) else {}
    if any(s > 0.0 for _, s in targets.values()) and method.thresholds is None:  # a budget that prunes
        per_layer = 0.0 if not blocks else (0.0,) * blocks
        return dataclasses.replace(method, thresholds=Thresholds(
            tuple((t, s) for t, (_, s) in targets.items()), tuple((t, (per_layer,) * L) for t in targets), SOURCE))
    if isinstance(method, (WandaSP, FLAP)) and method.selection is None:
        n_keep = method.n_keep(cfg)
        if n_keep == f:
            return method
        bias = tuple((0.0,) * d for _ in range(rows)) if isinstance(method, FLAP) else None
        kept = (tuple(range(n_keep)),) * rows
        return dataclasses.replace(method, selection=ChannelSelection(method.name, method.ratio, kept, bias, SOURCE, blocks))
    if isinstance(method, GLASS) and method.prior is None:
        return dataclasses.replace(method, prior=GlobalPrior(SOURCE, _zeros(rows, f), blocks))
    if isinstance(method, LaRoSa) and method.rotations is None:
        return dataclasses.replace(method, rotations=Rotations(SOURCE, _zeros(rows, d, d), blocks))
    if isinstance(method, PrincipalTEAL) and method.fit is None and method.sparsity(cfg) > 0.0:
        fit = PrincipalFit(SOURCE, _zeros(rows, d, method.rank), _zeros(rows), _zeros(rows), method.densities(cfg), blocks)
        return dataclasses.replace(method, fit=fit)
    if isinstance(method, WINA) and method.norms is None:
        return dataclasses.replace(method, norms=ColumnNorms(SOURCE, _zeros(rows, d), blocks))
    if isinstance(method, LowRankPOP) and method.factors is None:
        r = method.rank
        return dataclasses.replace(method, factors=LowRankFactors(SOURCE, r, _zeros(rows, 2, d, r), _zeros(rows, 2, r, f), blocks))
    if isinstance(method, BlockOrdered) and method.needs_calibration and method.order is None:
        return dataclasses.replace(method, order=ChannelOrder(SOURCE, np.broadcast_to(np.arange(f, dtype=np.int32), (L, f))))
    if isinstance(method, LayerBandsPOP) and method.allocation is None:
        return method.with_drift(np.ones(rows), SOURCE)
    return method


def abstract_data(method: Method, cfg: ModelConfig, dtype: str, sharding: Any = None) -> Any:
    """The method's calibrated data for ``cfg`` as ShapeDtypeStructs (None when it has none),
    each leaf given ``sharding`` (e.g. replicated over a mesh) when one is passed."""
    data = jax.eval_shape(lambda: method.data(ShapeModel(cfg, jnp.dtype(dtype).name)))
    if data is None or sharding is None:
        return data
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), data)
