"""``LoadedModel``: a model as ``popjax.load`` returns it and every layer above reads it (config,
NNX graphdef, params, tokenizer), and the two views of its layers: unrolled (``model.layers[i]``,
what offline calibration walks) and scanned (stacked for ``lax.scan``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from . import sharding
from .images import ImageProcessorConfig
from .models.config import ModelConfig
from .models.decoder import abstract_model
from .models.interface import FFNStack
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
    # copies of the weights in a kernel's layout, built once per model (`derived`); not copied by
    # dataclasses.replace, so a model with other weights never reads another's
    _derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, name: str, build: Callable[["LoadedModel"], Any]) -> Any:
        """``build(self)``, computed once per model and kept while the model lives: a copy of its
        weights in a kernel's layout (TEAL's input-major rows), not rebuilt at every call."""
        if name not in self._derived:
            self._derived[name] = build(self)
        return self._derived[name]

    def derived_names(self) -> frozenset:
        """The names of the derived copies this model holds now (`derived`)."""
        return frozenset(self._derived)

    def release_derived(self, keep: frozenset) -> None:
        """Drops the derived copies not named in ``keep`` (a method that fell back from the kernel
        that read them: `popjax.requests.GenerationRequest.kernels_checked`); JAX frees their
        device memory once nothing else holds them."""
        for name in set(self._derived) - set(keep):
            del self._derived[name]

    def ffn_stack(self) -> FFNStack:
        """Every layer's FFN weights stacked (`models.interface.FFNStack`): a scanned model's
        stack as it is, an unrolled model's layers stacked (a copy). ValueError on a
        mixture-of-experts model or one with per-layer FFN widths."""
        check_uniform_ffn(self.config)
        pure = nnx.to_pure_dict(self.params)
        if "layer_stack" in pure:
            mlp = pure["layer_stack"]["mlp"]
        else:
            layers = pure["layers"]
            mlp = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *(layers[i]["mlp"] for i in sorted(layers)))
        return FFNStack(mlp["gate_up"], mlp["down"], mlp.get("gate_up_scale"), mlp.get("down_scale"))


def uniform_ffn(cfg: ModelConfig) -> bool:
    """Whether the model has one dense FFN per layer, all of one width (what `LoadedModel.ffn_stack` stacks)."""
    return cfg.moe is None and cfg.intermediate_sizes is None


def check_uniform_ffn(cfg: ModelConfig) -> None:
    """A stack of FFN weights needs one dense FFN per layer, all of one width."""
    if not uniform_ffn(cfg):
        kind = "a mixture-of-experts" if cfg.moe is not None else "a per-layer-width"
        raise ValueError(f"{cfg.model_type}: {kind} model has no stack of equal FFN weights (a dense model of uniform width has)")


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
