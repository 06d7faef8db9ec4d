"""Streaming readers for HF safetensors directories and GGUF files.

Each reader yields ``(source_name, np.ndarray)`` one tensor at a time in the HF ``[out, in]``
layout, so peak memory stays near one tensor plus the converted result.
"""

from __future__ import annotations

import functools
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

# GGUF ``general.architecture`` -> the HF ``model_type`` whose config it describes
_GGUF_ARCHES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def open_gguf(path: Path):
    """A `GGUFReader` of ``path``, shared by the callers of one process while the file is
    unchanged: the reader parses every metadata field up front (the default model's 49,152
    tokens and merges: ~9 s on a 2-core machine), and a conversion reads the file twice, for its
    tensors and for its tokenizer. Read-only: no caller changes it."""
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int):
    """One reader per (file, modification time, size): `open_gguf`."""
    try:
        return GGUFReader(path)
    except Exception as err:
        raise CheckpointError(f"corrupt or unreadable GGUF file {path}: {err}") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07), so a
    config read from a GGUF equals the HF one it was converted from."""
    return float(str(np.float32(value)))


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
        "model_type": _GGUF_ARCHES[arch],
        "vocab_size": int(names["token_embd.weight"].shape[-1]),  # GGUF shapes are [in, out]
        "hidden_size": d,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", d // heads)),
        "rms_norm_eps": _f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":
        raw.update(_gemma3_fields(reader, path, raw))
    return ModelConfig.from_hf_dict(raw)


def _gemma3_fields(reader, path: Path, raw: dict) -> dict:
    """The Gemma 3 fields of a ``gemma3`` GGUF, read and derived as llama.cpp does.

    llama.cpp's converter (``Gemma3Model.set_gguf_parameters``) writes neither the layer pattern
    nor the attention scale, and older converters no local RoPE base (``rope.freq_base_swa``); its
    loader (``src/llama-model.cpp``, ``case LLM_ARCH_GEMMA3``) derives them. Each value below
    follows that loader, so a file means here what it means to llama.cpp. Returns HF config
    fields (transformers 4.x names) to add to ``raw``."""
    n, d, heads, head_dim = raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"], raw["head_dim"]
    value_dim = int(_field(reader, "gemma3.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ConfigError(
            f"gemma3.attention.value_length={value_dim} differs from key_length={head_dim} in {path}; "
            "popjax runs Gemma 3 with one head size for keys and values"
        )
    # Sliding-window layers exist only when the file gives a window > 0 (llama.cpp: "found_swa &&
    # n_swa > 0", else every layer is full). Which layers slide: llama_hparams::set_swa_pattern,
    # layer i slides iff i % period < period - 1 (every period-th layer, 1-based, is full); the
    # period is 6 unless ``attention.sliding_window_pattern`` says otherwise (a period, or one
    # bool per layer, true = sliding, the layout llama.cpp's swa_layers array has).
    window = int(_field(reader, "gemma3.attention.sliding_window", 0) or 0)
    pattern = _field(reader, "gemma3.attention.sliding_window_pattern", 6)
    if window <= 0:
        sliding = [False] * n
    elif isinstance(pattern, list):
        if len(pattern) != n:
            raise ConfigError(
                f"gemma3.attention.sliding_window_pattern in {path} has {len(pattern)} entries; "
                f"give one per layer ({n}) or a period"
            )
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(n)]  # 0: llama.cpp slides all
    return {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": window if window > 0 else None,
        # the sliding layers' RoPE: base 10000 and no scaling, which llama.cpp hard-codes for
        # Gemma 3 (rope_freq_base_train_swa) and newer files also state in rope.freq_base_swa
        "rope_local_base_freq": _f32(_field(reader, "gemma3.rope.freq_base_swa", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(reader, "gemma3"),
        # llama.cpp's f_attention_scale: 1/sqrt(n_embd / n_head) for the 27B (62 layers; its
        # query_pre_attn_scalar is 168 = 5376 / 32), 1/sqrt(head_dim) for every other size
        "query_pre_attn_scalar": d // heads if n == 62 else head_dim,
        # optional; absent or 0 means none (llama.cpp's default f_final_logit_softcapping = 0)
        "final_logit_softcapping": _f32(cap) if (cap := _field(reader, "gemma3.final_logit_softcapping")) else None,
        "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's LLM_FFN_GELU: the tanh form
        # an instruction-tuned Gemma ends its turn with <end_of_turn> (eot), which llama.cpp also
        # stops at; HF's configs list both ids ([1, 106])
        "eos_token_id": _stop_ids(raw["eos_token_id"], _field(reader, "tokenizer.ggml.eot_token_id")),
    }


def _stop_ids(eos, eot) -> list[int] | int | None:
    ids = [int(i) for i in ([] if eos is None else eos if isinstance(eos, list) else [eos])]
    if eot is not None and int(eot) not in ids:
        ids.append(int(eot))
    return ids or None


def _gguf_rope_scaling(reader, arch: str) -> dict | None:
    """llama.cpp's global RoPE scaling: ``rope.scaling.factor`` (or the older ``rope.scale_linear``)
    under ``rope.scaling.type`` (default "linear"); no factor means no scaling. Any type but
    linear is passed on by name, for `ModelConfig` to accept or reject."""
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = _field(reader, f"{arch}.rope.scale_linear")
    kind = _field(reader, f"{arch}.rope.scaling.type", "linear")
    if kind == "none" or not factor:
        return None
    return {"rope_type": kind, "factor": _f32(factor)}


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
