"""Source checkpoint -> popjax parameter tree, one tensor at a time, with every name and shape checked."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from ..models import moe as moe_shapes
from ..models.config import ModelConfig
from ..models.vision_config import vision_tensor_shapes
from . import names, readers
from .fused_experts import split_fused_experts
from .readers import CheckpointError

_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


@dataclasses.dataclass
class ConvertedCheckpoint:
    """A converted model: its config and a nested dict (str keys) of numpy arrays."""

    config: ModelConfig
    params: dict[str, Any]


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Dotted path -> shape of every tensor a converted checkpoint holds (HF [out, in] layout)."""
    d, f, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"embed": (V, d), "final_norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, d)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,),
            p + "mlp_norm.weight": (d,),
            p + "attn.q": (cfg.q_dim, d),
            p + "attn.k": (cfg.kv_dim, d),
            p + "attn.v": (cfg.kv_dim, d),
            p + "attn.o": (d, cfg.q_dim),
            p + "mlp.gate": (f, d),
            p + "mlp.up": (f, d),
            p + "mlp.down": (d, f),
        })
        if cfg.moe is not None:  # the layer's FFN: routed/shared experts or a dense FFN of its own width
            for name in ("gate", "up", "down"):
                del shapes[p + "mlp." + name]
            shapes.update({p + "mlp." + k: v for k, v in moe_shapes.checkpoint_shapes(cfg, i).items()})
        if cfg.qkv_bias:
            shapes.update({p + "attn.q_bias": (cfg.q_dim,), p + "attn.k_bias": (cfg.kv_dim,), p + "attn.v_bias": (cfg.kv_dim,)})
        if cfg.qk_norm:
            shapes.update({p + "attn.q_norm.weight": (cfg.head_dim,), p + "attn.k_norm.weight": (cfg.head_dim,)})
        if cfg.sandwich_norms:
            shapes.update({p + "attn_post_norm.weight": (d,), p + "mlp_post_norm.weight": (d,)})
    if cfg.vision is not None:  # a VLM's tower, under its HF names (models/vision_config.py)
        shapes.update(vision_tensor_shapes(cfg.vision, "vision."))
    return shapes


def check_dtype(dtype: str) -> None:
    if dtype not in _NUMPY_DTYPES:
        hint = " (the compute dtype; int8 is a weight format: weights='int8', --weights int8)" if "int" in str(dtype) else ""
        raise ValueError(f"dtype={dtype!r} is not supported{hint}; use one of {sorted(_NUMPY_DTYPES)}")


def assemble(
    cfg: ModelConfig,
    tensors: Iterator[tuple[str, np.ndarray]],
    total: int,
    rules: tuple[names.Rule, ...],
    ignored: tuple[str, ...],
    source: str,
    dtype: str = "float32",
    unpermute: bool = False,
) -> dict[str, Any]:
    """Maps, transforms, shape-checks and casts each tensor; fails on unmapped, duplicate or
    missing ones. Returns the nested parameter dict."""
    check_dtype(dtype)
    want = checkpoint_shapes(cfg)
    flat: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    for name, array in tqdm(tensors, total=total, desc=f"converting {Path(source).name}", unit="tensor"):
        if names.is_ignored(ignored, name):
            continue
        if name in ("lm_head.weight", "output.weight") and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding, some exporters still save a copy
        hit = names.match(rules, name)
        if hit is None:
            raise CheckpointError(f"tensor {name!r} in {source} has no mapping to a popjax parameter")
        target, transform = hit
        if target not in want:
            raise CheckpointError(
                f"tensor {name!r} in {source} maps to {target!r}, which a {cfg.model_type} model "
                f"with this config does not have"
            )
        if target in flat:
            raise CheckpointError(f"tensors {origin[target]!r} and {name!r} in {source} both map to {target!r}")
        array = names.apply_transform(np.asarray(array), transform, cfg, unpermute)
        if tuple(array.shape) != want[target]:
            raise CheckpointError(
                f"tensor {name!r} in {source} has shape {tuple(array.shape)} after conversion, "
                f"expected {want[target]} for {target!r}"
            )
        flat[target] = array.astype(_NUMPY_DTYPES[dtype])
        origin[target] = name
    missing = sorted(set(want) - set(flat))
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"checkpoint {source} lacks {len(missing)} parameter(s): {shown}")
    return unflatten(flat)


def unflatten(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def convert_hf(directory: Path, dtype: str = "float32") -> ConvertedCheckpoint:
    """A HF checkpoint directory (config.json + safetensors, single or sharded)."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    cfg = readers.hf_config(directory)
    files = readers.hf_shard_files(directory)
    params = assemble(
        cfg,
        split_fused_experts(cfg, readers.iter_hf_tensors(files)),  # Qwen3-VL-MoE's [E, …] expert tensors, per expert
        readers.hf_tensor_count(files),
        names.hf_rules(cfg),
        names.HF_IGNORED,
        str(directory),
        dtype,
    )
    return ConvertedCheckpoint(cfg, params)


def convert_gguf(path: Path, dtype: str = "float32") -> ConvertedCheckpoint:
    """A llama.cpp GGUF file (any quantisation `gguf` can dequantize)."""
    reader = readers.open_gguf(path)
    cfg = readers.gguf_config(reader, path)
    params = assemble(
        cfg,
        readers.iter_gguf_tensors(reader, path),
        len(reader.tensors),
        names.gguf_rules(cfg),
        names.GGUF_IGNORED,
        str(path),
        dtype,
        unpermute=cfg.model_type == "llama",
    )
    return ConvertedCheckpoint(cfg, params)

