"""Checkpoint conversion: HF safetensors and GGUF -> popjax params, and the converted-checkpoint store."""

from .convert import ConvertedCheckpoint, convert_gguf, convert_hf
from .default_model import DEFAULT_MODEL, default_gguf_path
from .readers import CheckpointError

__all__ = [
    "CheckpointError",
    "ConvertedCheckpoint",
    "DEFAULT_MODEL",
    "convert_gguf",
    "convert_hf",
    "default_gguf_path",
]
