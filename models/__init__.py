"""Architectures: LLaMA, Qwen2 and Qwen3 decoders sharing one Flax NNX implementation."""

from .config import ConfigError, ModelConfig, RopeScaling
from .decoder import DecoderLayer, Transformer, abstract_model
from .layers import Derived, KVCache
from .scan import ScannedTransformer, scan_layers

__all__ = [
    "ConfigError",
    "DecoderLayer",
    "Derived",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "ScannedTransformer",
    "Transformer",
    "abstract_model",
    "scan_layers",
]
