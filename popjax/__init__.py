"""popjax: large language models in JAX/Flax with online structured pruning of their FFNs.

    params = popjax.load()                       # SmolLM2-135M-Instruct, converted once
    out = popjax.generate(params, "Hello", method=popjax.POP(ratio=0.2, gamma=0.1))
    print(out.text)
"""

from .libtpu_env import prepare_when_libtpu_starts

# sets nothing now: JAX's TPU backend sets libtpu's environment just before it loads libtpu (off a
# TPU VM, an installed libtpu then starts quietly); a GPU or CPU run's environment is left alone
prepare_when_libtpu_starts()
from . import engine  # noqa: E402
from .generation import Generation, StreamPiece, forward, generate, generate_ids, stream, stream_ids
from .loading import convert_source, load
from .loaded import LoadedModel
from . import calibration, pruned, sharding
from .analysis import flops, layer_importance, memory_plan
from .methods.prefill_only import kv_calibration
from .methods import (
    BWAP, CATS, FLAP, GRIFFIN, METHODS, POP, TEAL, Dense, Dynamic, Method, MethodError, PrefillOnly, ProbePruning,
    Static, WandaSP, make_method, GateScoredPOP, LowRankPOP, LayerBandsPOP, ShortlistPOP,
    ShortlistDynamic, WINA, GLASS, LaRoSa, PrincipalTEAL,
)
from .convert.default_model import DEFAULT_MODEL

__version__ = "0.1.0"

__all__ = [
    "BWAP",
    "CATS",
    "FLAP",
    "GRIFFIN",
    "GateScoredPOP",
    "LayerBandsPOP",
    "LowRankPOP",
    "ShortlistPOP",
    "ShortlistDynamic",
    "ProbePruning",
    "TEAL",
    "WandaSP",
    "WINA",
    "GLASS",
    "LaRoSa",
    "PrincipalTEAL",
    "calibration",
    "layer_importance",
    "memory_plan",
    "sharding",
    "pruned",
    "DEFAULT_MODEL",
    "METHODS",
    "Dense",
    "Dynamic",
    "Generation",
    "LoadedModel",
    "Method",
    "MethodError",
    "POP",
    "PrefillOnly",
    "Static",
    "StreamPiece",
    "convert_source",
    "engine",
    "forward",
    "generate",
    "generate_ids",
    "load",
    "make_method",
    "stream",
    "stream_ids",
]
