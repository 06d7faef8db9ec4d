"""Architectures: LLaMA, Qwen2/3, their MoE variants, Gemma 3 and Qwen2-VL's text model, one Flax NNX
decoder with switches in `ModelConfig`; the typed call in `models.interface`."""

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
