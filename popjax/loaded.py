"""``LoadedModel``: a model as ``popjax.load`` returns it and every layer above reads it (config,
NNX graphdef, params, tokenizer), and the two views of its layers: unrolled (``model.layers[i]``,
what offline calibration walks) and scanned (stacked for ``lax.scan``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import sharding
from .images import ImageProcessorConfig
from .models.config import ModelConfig
from .models.decoder import abstract_model
from .models.scan import scan_layers as stack_model_layers


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What ``popjax.load`` returns: pass it to ``generate``/``forward``.

    ``params`` is an ``nnx.State`` pytree (parameters plus derived constants such as the
    per-channel ‖W_d[:, j]‖₂); ``graphdef`` is the static structure, hashable for jit."""

    config: ModelConfig
    graphdef: Any
    params: Any
    tokenizer: Any
    source: str
    dtype: str
    mesh: Any = None  # a jax Mesh when the params are sharded over devices (popjax.sharding)
    # a vision-language model's vision tower (models/vision.py params, replicated; it stays dense)
    # and its image preprocessing (the checkpoint's preprocessor_config.json, else Qwen2-VL's defaults)
    vision: Any = None
    image_processor: ImageProcessorConfig | None = None


def with_scanned_layers(model: LoadedModel) -> LoadedModel:
    """An unrolled loaded model -> the same weights with the layers stacked for ``lax.scan``
    (models.scan.scan_layers; done once, here, outside any jit). With a mesh, the stacked
    parameters are placed in their shardings (the layer axis is not split)."""
    scanned = stack_model_layers(nnx.merge(model.graphdef, model.params))
    graphdef, state = nnx.split(scanned)
    loaded = dataclasses.replace(model, graphdef=graphdef, params=state)
    if model.mesh is not None:
        loaded = sharding.shard_params(loaded, model.mesh)
    return loaded


def unrolled(model: LoadedModel) -> LoadedModel:
    """A scanned model (``scan_layers=True``) -> the same weights as the unrolled Transformer,
    for the code that walks ``model.layers[i]`` (offline calibration, layer analysis); an
    unrolled model is returned as it is. Each layer's parameters are sliced out of the stacks
    (a copy of the layer weights while the result lives)."""
    pure = nnx.to_pure_dict(model.params)
    if "layer_stack" not in pure:
        return model
    stack = pure.pop("layer_stack")
    graphdef, state = nnx.split(abstract_model(model.config, jnp.dtype(model.dtype)))
    target = nnx.to_pure_dict(state)
    target.update(pure)
    target["layers"] = {i: jax.tree_util.tree_map(lambda a, i=i: a[i], stack) for i in target["layers"]}
    nnx.replace_by_pure_dict(state, target)
    return dataclasses.replace(model, graphdef=graphdef, params=state)
