"""Random weights of a real model's shapes, made on the device: ``popjax bench --synthetic`` and
``popjax device-check`` time a Llama-3.1-8B (or any shipped config) without a checkpoint, a
download or a tokenizer.

* `synthetic_config`: a shipped config name (``popjax/configs/*.json``) or a ``config.json``
  path, cut to its first ``layers`` layers, in the weight format asked (float or int8);
* `synthetic_model`: a `LoadedModel` of that config whose every parameter is drawn by a jitted
  random op on the default device, in its own dtype (bf16/fp32 values, int8 values with fp32
  scales): nothing is built on the host and copied over, so an 8B layer costs no host memory;
* `random_prompts`: token-id prompts (no tokenizer);
* `fitted`: an offline method (TEAL, CATS, ...) with placeholder fits of the right shapes
  (`analysis.shape_fitted`): its programs compile and run, but the placeholder values decide
  its selections (zero thresholds keep every nonzero input), so its *time* is that of the
  placeholder selection, not of a calibrated one. `fit_note` says which, for the JSON.

The values are scaled like an initialised network (weights ~ N(0, 1/fan_in); int8 values
uniform in [-127, 127] with scales 1/(127·√fan_in)), so activations and logits stay finite
through any number of layers; they mean nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..analysis.memory_plan import resolve_config
from ..analysis.shape_fitted import SOURCE as PLACEHOLDER_SOURCE
from ..analysis.shape_fitted import shape_fitted
from ..loaded import LoadedModel
from ..loading import with_activations
from ..methods import Method
from ..models.config import ModelConfig
from ..models.decoder import abstract_model
from ..models.scan import abstract_scanned_model
from ..kernels.int8 import WEIGHT_FORMATS

SYNTHETIC_PREFIX = "synthetic:"


def synthetic_config(model: str, layers: int | None = None, weights: str = "float") -> ModelConfig:
    """``model`` (a shipped config name or a config.json path) -> its `ModelConfig`, cut to its
    first ``layers`` layers (None: all), with linear weights ``weights`` ("float" or "int8").
    ValueError naming the bad value and what is valid."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is not a weight format; choose from {', '.join(WEIGHT_FORMATS)}")
    cfg = resolve_config(model)  # ValueError naming the shipped configs
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= cfg.num_hidden_layers:
            raise ValueError(f"layers={layers!r} is invalid for {model} ({cfg.num_hidden_layers} layers); use an integer in [1, {cfg.num_hidden_layers}]")
        cfg = cut_layers(cfg, layers)
    return dataclasses.replace(cfg, weights=weights)


def check_run(model: str | None, layers: int | None, suites, mesh) -> None:
    """What a ``popjax bench --synthetic`` run takes: ValueError naming the flag that does not fit
    (``lengths`` needs text and a tokenizer, a mesh a checkpoint; ``layers`` needs ``model``)."""
    if model is None:
        if layers is not None:
            raise ValueError(f"layers={layers!r} cuts a synthetic model; give --synthetic MODEL too, or drop --layers")
        return
    synthetic_config(model, layers)  # the config and the layer count, before any weight
    if "lengths" in suites:
        raise ValueError("suite 'lengths' cuts prompts from real text with a tokenizer; a --synthetic model has none: "
                         "choose from decode, capacity, stream, memory")
    if mesh is not None:
        raise ValueError("--synthetic draws its weights on one device; drop --mesh (a mesh needs a loaded checkpoint)")


def cut_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """``cfg`` with its first ``n`` layers (their kinds, widths and MoE layers kept)."""
    moe = cfg.moe
    if moe is not None and moe.sparse_layers:
        moe = dataclasses.replace(moe, sparse_layers=tuple(i for i in moe.sparse_layers if i < n))
    kinds = None if cfg.layer_types is None else cfg.layer_types[:n]
    widths = None if cfg.intermediate_sizes is None else tuple(cfg.intermediate_sizes[:n])
    return dataclasses.replace(cfg, num_hidden_layers=n, moe=moe, layer_types=kinds, intermediate_sizes=widths)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "kind", "fan_in"))
def _draw(key: jax.Array, *, shape: tuple[int, ...], dtype: str, kind: str, fan_in: int) -> jax.Array:
    """One parameter drawn on the device: kind "normal" (N(0, 1/fan_in)), "int8" (uniform
    int8 values), "scale" (1/(127·√fan_in), an int8 weight's per-row scale), "ones", "zeros"."""
    if kind == "normal":
        return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)
    if kind == "int8":
        return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
    if kind == "scale":
        return jnp.full(shape, 1.0 / (127.0 * np.sqrt(fan_in)), dtype)
    return jnp.ones(shape, dtype) if kind == "ones" else jnp.zeros(shape, dtype)


def _kind(name: str, shape: tuple[int, ...], dtype, shapes: dict[str, tuple[int, ...]]) -> tuple[str, int]:
    """How parameter ``name`` is drawn and its fan-in (an int8 weight's scale takes its
    weight's: ``x_scale`` scales ``x``)."""
    if name.endswith("_scale") and name[: -len("_scale")] in shapes:
        return "scale", shapes[name[: -len("_scale")]][-1]
    if jnp.dtype(dtype) == jnp.int8:
        return "int8", 1
    if len(shape) < 2:  # norms' weights 1 (a zero-centred norm then scales by 2), biases 0
        return ("ones" if "norm" in name else "zeros"), 1
    return "normal", shape[-1]


def synthetic_model(cfg: ModelConfig, dtype: str = "bfloat16", scan_layers: bool = False, seed: int = 0,
                    source: str | None = None) -> LoadedModel:
    """A `LoadedModel` of ``cfg`` with random weights drawn on the default device in ``dtype``
    (int8 linear layers when ``cfg.weights == "int8"``), its derived constants computed as
    loading computes them (``finalize``). No tokenizer: feed token ids (`random_prompts`)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} is not a compute dtype of a synthetic model; use float32 or bfloat16")
    if cfg.vision is not None:
        raise ValueError(f"{cfg.model_type} is a vision-language model; --synthetic times text models (its vision tower has no synthetic weights)")
    dt = jnp.dtype(dtype)
    abstract = abstract_scanned_model(cfg, dt) if scan_layers else abstract_model(cfg, dt)
    graphdef, state = nnx.split(abstract)
    flat = [(".".join(str(k) for k in path), var) for path, var in nnx.to_flat_state(state)]
    shapes = {name: tuple(var.get_value().shape) for name, var in flat}
    keys = jax.random.split(jax.random.key(seed), len(flat))
    for key, (name, var) in zip(keys, flat):
        value = var.get_value()
        kind, fan_in = _kind(name, shapes[name], value.dtype, shapes)
        var.set_value(_draw(key, shape=shapes[name], dtype=jnp.dtype(value.dtype).name, kind=kind, fan_in=fan_in))
    model = nnx.merge(graphdef, state)
    model.finalize()  # derived constants (down_norm, ...) from the drawn weights, as loading does
    graphdef, state = nnx.split(model)
    cfg = with_activations(cfg, None)
    return LoadedModel(cfg, graphdef, state, None, source or f"{SYNTHETIC_PREFIX}{cfg.model_type}", dt.name)


def random_prompts(cfg: ModelConfig, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of ``length`` random token ids in [0, vocab) (what a decode step costs
    does not depend on the ids)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, size=(batch, length)).tolist()


def fitted(method: Method, cfg: ModelConfig) -> Method:
    """``method`` ready for a synthetic model without calibration: an offline method gets
    placeholder fits of the right shapes (`analysis.shape_fitted`), every other is returned as
    it is. (Calibrating on random weights would fit noise, and hash every weight.)"""
    return shape_fitted(method, cfg)


def holds_placeholder(node: Any) -> bool:
    """Whether ``node`` (a method, or a fit inside one) holds a `shape_fitted` placeholder: a
    fit whose ``source`` is the placeholder's."""
    if getattr(node, "source", None) == PLACEHOLDER_SOURCE:
        return True
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return False
    return any(holds_placeholder(getattr(node, f.name)) for f in dataclasses.fields(node))


def fit_note(method: Method, cfg: ModelConfig) -> str | None:
    """What the JSON says of ``method``'s fits on a synthetic model (before or after `fitted`):
    None for a method that needs none, else that they are shape-only placeholders."""
    if fitted(method, cfg) is method and not holds_placeholder(method):
        return None
    return f"{PLACEHOLDER_SOURCE}: offline fits of the right shapes, placeholder values (zeros, first channels): " \
           "its selections, and so its time, are the placeholder's, not a calibrated model's"


def describe(cfg: ModelConfig, dtype: str, model: str, seed: int) -> dict[str, Any]:
    """The JSON record of what a synthetic run measured."""
    return {"synthetic": True, "config": model, "layers": cfg.num_hidden_layers, "weights": cfg.weights, "dtype": dtype,
            "seed": seed, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "weights_note": "random weights drawn on the device (popjax.bench.synthetic); no checkpoint, no tokenizer"}
