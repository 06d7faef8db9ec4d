"""Streaming readers for HF safetensors directories and GGUF files.

Each reader yields ``(source_name, np.ndarray)`` one tensor at a time in the HF ``[out, in]``
layout, so peak memory stays near one tensor plus the converted result.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open

from ..models.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be converted: missing, corrupt, unmapped or mis-shaped."""


# ---------------------------------------------------------------- HF safetensors


def hf_shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF checkpoint directory (single file or sharded index)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"corrupt shard index {index}: {err}") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"no model.safetensors or model.safetensors.index.json in {directory}"
            )
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing (listed in the shard index)")
    return files


def hf_config(directory: Path) -> ModelConfig:
    return ModelConfig.from_json(directory / "config.json")


def hf_tensor_count(files: list[Path]) -> int:
    total = 0
    for file in files:
        with _open_safetensors(file, safe_open) as handle:
            total += len(handle.keys())
    return total


def iter_hf_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    for file in files:
        with _open_safetensors(file, safe_open) as handle:
            for name in handle.keys():
                try:
                    yield name, np.asarray(handle.get_tensor(name))
                except Exception as err:  # safetensors raises its own error types
                    raise CheckpointError(f"cannot read tensor {name!r} from {file}: {err}") from None


def _open_safetensors(file: Path, safe_open):
    # "flax" returns jax arrays, which also covers bf16 checkpoints that numpy cannot type.
    try:
        return safe_open(str(file), framework="flax")
    except Exception as err:
        raise CheckpointError(f"corrupt or unreadable safetensors file {file}: {err}") from None


# ---------------------------------------------------------------- GGUF

_GGUF_ARCHES = ("llama", "qwen2", "qwen3")


def open_gguf(path: Path):
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path))
    except Exception as err:
        raise CheckpointError(f"corrupt or unreadable GGUF file {path}: {err}") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, path: Path) -> ModelConfig:
    """Builds the HF-style config from GGUF metadata (llama.cpp key names)."""
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHES:
        raise ConfigError(
            f"unsupported architecture general.architecture={arch!r} in {path}; "
            f"supported: {list(_GGUF_ARCHES)}"
        )
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError(
            f"{path} uses llama3 rope scaling through a rope_freqs tensor, which popjax reads only "
            "from HF safetensors checkpoints (rope_scaling in config.json)"
        )
    if "token_embd.weight" not in names:
        raise CheckpointError(f"GGUF file {path} lacks the tensor 'token_embd.weight'")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    d = int(_field(reader, f"{arch}.embedding_length"))
    raw = {
        "model_type": arch,
        "vocab_size": int(names["token_embd.weight"].shape[-1]),
        "hidden_size": d,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", d // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    return ModelConfig.from_hf_dict(raw)


def iter_gguf_tensors(reader, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    for tensor in reader.tensors:
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except Exception as err:
            raise CheckpointError(
                f"cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}) in {path}: {err}"
            ) from None
        yield tensor.name, values


def gguf_tokenizer(path: Path):
    """The tokenizer a GGUF file describes, as a transformers fast tokenizer, built without
    torch: transformers' own GGUF reader imports torch, so the metadata is read here with the
    ``gguf`` package and handed to transformers' (torch-free) tokenizer converter, grouped the
    same way ``transformers.integrations.gguf.get_gguf_tokenizer`` groups it."""
    # heavy: importing transformers takes seconds, and only a GGUF source needs its tokenizer here
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # heavy: see above
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    reader = open_gguf(path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer:
        raise CheckpointError(f"GGUF file {path} has no tokenizer (tokenizer.ggml.tokens is missing)")
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
