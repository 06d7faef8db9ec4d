"""FFN FLOPs accounting per decode token: analytic (docs/methods.md §2) and from XLA's cost analysis.

XLA's count comes from compiling the real decode step on abstract (shape-only) inputs, so it
needs no weights and measures exactly what the engine runs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import engine
from ..methods import Dense, Method, StaticPlan
from ..methods.base import Plan
from ..models.config import ModelConfig
from ..models.decoder import abstract_model
from ..sampling import SamplingParams


def analytic_ffn_flops(cfg: ModelConfig, plan: Plan) -> int:
    """FFN FLOPs per decode token, summed over layers."""
    return cfg.num_hidden_layers * plan.ffn_flops_per_token(cfg.hidden_size)


def flops_report(cfg: ModelConfig, method: Method) -> dict[str, Any]:
    """Analytic per-token FFN FLOPs of a method and its overhead over static at the same kept
    channel count, as a fraction of the dense FFN (the paper's "extra FFN FLOPs")."""
    plan = method.bind(cfg)
    dense = analytic_ffn_flops(cfg, Dense().bind(cfg))
    flops = analytic_ffn_flops(cfg, plan)
    static = analytic_ffn_flops(cfg, StaticPlan(f=plan.f, n_keep=plan.n_keep))
    return {
        "ffn_flops_per_token": flops,
        "dense_ffn_flops_per_token": dense,
        "ffn_fraction_of_dense": flops / dense,
        "overhead_vs_static_of_dense": (flops - static) / dense,
    }


@functools.lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig, dtype: str):
    graphdef, state = nnx.split(abstract_model(cfg, jnp.dtype(dtype)))
    return graphdef, state


def abstract_carry(cfg: ModelConfig, plan: Plan, batch: int, prompt_len: int, capacity: int, dtype: str = "float32"):
    """Shape-only (graphdef, params, carry) of a generation after prefill: no weights allocated."""
    graphdef, params = _abstract(cfg, dtype)
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    sampling = jax.eval_shape(lambda: SamplingParams.create())
    stops = jax.ShapeDtypeStruct((8,), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    carry, _ = jax.eval_shape(
        functools.partial(engine.start, graphdef, plan=plan, capacity=capacity),
        params, tokens=tokens, mask=tokens, key=key, sampling=sampling, stop_ids=stops, pad_id=scalar,
    )
    return graphdef, params, carry, sampling, stops, scalar


def xla_decode_step_flops(
    cfg: ModelConfig, method: Method, batch: int = 1, prompt_len: int = 32, capacity: int = 64, dtype: str = "float32"
) -> float:
    """FLOPs of one compiled generation step (whole model, sampling included) from XLA's cost
    analysis of the engine's own step."""
    plan = method.bind(cfg)
    graphdef, params, carry, sampling, stops, pad = abstract_carry(cfg, plan, batch, prompt_len, capacity, dtype)
    lowered = engine.stream_step.lower(graphdef, params, plan, carry, sampling, stops, pad)
    cost = lowered.compile().cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost["flops"])


def linear_itemsize(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes per linear-layer (and LM-head) weight: 1 in an int8 model (its fp32 scales, one per
    output channel, add < 1% for d ≥ 512 and are not counted), else the dtype's ``itemsize``."""
    return 1 if cfg.weights == "int8" else itemsize


def ffn_bytes_per_step(cfg: ModelConfig, plan: Plan, batch: int, itemsize: int) -> int:
    """Bytes of FFN weights one decode step reads (all layers), as the plan counts them (in the
    model's weight format: int8 compact copies are int8 too)."""
    return cfg.num_hidden_layers * plan.ffn_weights_read_per_step(cfg.hidden_size, batch) * linear_itemsize(cfg, itemsize)


def bytes_per_step(cfg: ModelConfig, plan: Plan, batch: int, cache_slots: int, itemsize: int) -> int:
    """Weights (attention, FFN, LM head) plus the KV cache read by one decode step; ``itemsize``
    is the compute dtype's (KV caches), weights count `linear_itemsize`. A sliding-window layer
    reads at most its window of the ``cache_slots`` a full layer reads."""
    attention = cfg.num_hidden_layers * cfg.attention_params_per_layer() * linear_itemsize(cfg, itemsize)
    head = cfg.vocab_size * cfg.hidden_size * linear_itemsize(cfg, itemsize)
    read = sum(cache_slots if cfg.window(i) is None else min(cache_slots, cfg.window(i)) for i in range(cfg.num_hidden_layers))
    kv = 2 * read * cfg.kv_dim * itemsize * batch
    return attention + head + ffn_bytes_per_step(cfg, plan, batch, itemsize) + kv
