"""FFN FLOPs accounting per decode token: analytic (SPEC §2) and from XLA's cost analysis.

XLA's count comes from compiling the real decode step on abstract (shape-only) inputs, so it
needs no weights and measures exactly what the engine runs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import engine
from .methods import Dense, Method
from .methods.base import Plan
from .models.config import ModelConfig
from .models.decoder import abstract_model


def analytic_ffn_flops(cfg: ModelConfig, plan: Plan) -> int:
    """FFN FLOPs per decode token, summed over layers."""
    return cfg.num_hidden_layers * plan.ffn_flops_per_token(cfg.hidden_size)


def flops_report(cfg: ModelConfig, method: Method) -> dict[str, Any]:
    """Analytic per-token FFN FLOPs of a method and its overhead over static at the same kept
    channel count, as a fraction of the dense FFN (the paper's "extra FFN FLOPs")."""
    plan = method.bind(cfg)
    dense = analytic_ffn_flops(cfg, Dense().bind(cfg))
    flops = analytic_ffn_flops(cfg, plan)
    static = cfg.num_hidden_layers * 6 * cfg.hidden_size * plan.n_keep
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


def xla_decode_step_flops(
    cfg: ModelConfig, method: Method, batch: int = 1, prompt_len: int = 32, capacity: int = 64, dtype: str = "float32"
) -> float:
    """FLOPs of one compiled decode step (whole model) from XLA's cost analysis."""
    graphdef, params = _abstract(cfg, dtype)
    plan = method.bind(cfg)
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    _, caches, states, _ = jax.eval_shape(
        functools.partial(engine.prefill, graphdef, plan=plan), params, tokens, tokens
    )
    S = prompt_len + capacity
    caches = jax.eval_shape(lambda c: engine.grow_caches(c, capacity), caches)
    vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    key_valid = jax.ShapeDtypeStruct((batch, S), jnp.bool_)
    lowered = engine.decode_step.lower(
        graphdef, params, plan, vec, vec, scalar, key_valid, caches, states, scalar
    )
    cost = lowered.compile().cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost["flops"])
