"""Offline structured pruning: a calibrated Wanda-sp or FLAP selection written into a smaller
checkpoint — what a user deploys (docs/methods.md §5.1–§5.2: both baselines are static).

    pruned = popjax.pruned.prune_model(model, popjax.FLAP(ratio=0.2))   # calibrates once (cached)
    popjax.pruned.save_pruned(pruned, "smollm2-flap20")                 # a converted directory
    pruned = popjax.load("smollm2-flap20")                               # like any converted model
    popjax.generate(pruned, "Hello")                                     # dense inference on it

The pruned checkpoint keeps, per layer, the kept gate/up rows and down columns (ascending channel
order). Wanda-sp keeps n_keep channels in every layer: the result is an ordinary model with
``intermediate_size = n_keep``, and every method runs on it. FLAP's layers differ in width: the
config gets ``intermediate_sizes`` (one width per layer; ``intermediate_size`` is then their mean,
exactly n_keep) and ``down_proj_bias`` (FLAP's bias compensation, one [d] vector per layer, added
by the dense plan); only dense inference runs on it (other methods' plans assume one f and raise
a MethodError).

**Mixture-of-experts models** are refused (a MethodError): HF MoE configs have one expert width
(``moe_intermediate_size``) for every expert, which FLAP's per-expert widths break, and the
checkpoint layout would have to undo popjax's block splitting of shared experts and dense layers
(docs/moe.md). On MoE models both methods run in their method form (per expert, static shapes).

**Scanned layers.** The decoder runs its layers as a Python loop, so layers of different widths
cost nothing extra. A scanned-layer mode (one ``lax.scan`` over stacked layer weights) needs one
shape: it would pad every layer to the widest with zero gate/up rows and zero down columns, which
contribute exactly 0 (silu(0)·0 = 0), at the cost of computing the padding.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .calibration import Corpus
from .convert.convert import unflatten
from .convert.fused import dequantize_tree
from .convert.store import write_converted
from .loading import build_model
from .loaded import LoadedModel
from .models.layers import split_qkv
from .models.vision_config import vision_tensors_to_hf
from .methods.base import MethodError
from .methods.wanda_sp import CalibratedPruning, ChannelSelection

log = logging.getLogger(__name__)


def _numpy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {str(k): _numpy(v) for k, v in tree.items()}
    return np.asarray(tree)


def checkpoint_tree(model: LoadedModel) -> dict[str, Any]:
    """The model's parameters as a converted-checkpoint tree (numpy, str keys, HF layout with q/k/v
    and gate/up apart, derived constants dropped; a VLM's vision tower included): the inverse of
    `convert.fused.fuse_checkpoint`."""
    cfg = model.config
    pure = dequantize_tree(_numpy(nnx.to_pure_dict(model.params)))  # an int8 model: q · s (re-quantized when fused)
    tree = {k: v for k, v in pure.items() if k != "layers"}
    tree["layers"] = {}
    for key, layer in pure["layers"].items():
        attn = dict(layer["attn"])
        attn.update(zip(("q", "k", "v"), split_qkv(attn.pop("qkv"), cfg)))
        if "qkv_bias" in attn:
            attn.update(zip(("q_bias", "k_bias", "v_bias"), split_qkv(attn.pop("qkv_bias"), cfg)))
        mlp = layer["mlp"]
        out_mlp = {"gate": mlp["gate_up"][0], "up": mlp["gate_up"][1], "down": mlp["down"]}
        if "down_bias" in mlp:
            out_mlp["down_bias"] = mlp["down_bias"]
        tree["layers"][key] = {**{k: v for k, v in layer.items() if k not in ("attn", "mlp")}, "attn": attn, "mlp": out_mlp}
    if model.vision is not None:  # a VLM's tower, under its HF names as the converter keeps them
        tree["vision"] = unflatten(vision_tensors_to_hf(model.vision, cfg.vision))["vision"]
    return tree


def prune_tree(tree: dict[str, Any], selection: ChannelSelection, dtype) -> dict[str, Any]:
    """Keeps each layer's selected channels (gate/up rows, down columns) and adds the bias."""
    out = {**tree, "layers": {}}
    for key, layer in tree["layers"].items():
        kept = np.asarray(selection.kept[int(key)], np.int64)
        mlp = layer["mlp"]
        pruned = {"gate": mlp["gate"][kept], "up": mlp["up"][kept], "down": mlp["down"][:, kept]}
        if selection.bias is not None:
            pruned["down_bias"] = np.asarray(np.asarray(selection.bias[int(key)], np.float32), dtype)
        out["layers"][key] = {**layer, "mlp": pruned}
    return out


def prune_model(model: LoadedModel, method: CalibratedPruning, corpus: Corpus | str | Path | None = None, **calibrate_kwargs: Any) -> LoadedModel:
    """``model`` with the FFN channels that ``method`` (WandaSP or FLAP, calibrated or not) prunes
    removed. Calibrates through popjax.calibration when ``method`` has no selection yet
    (``corpus`` and ``calibrate_kwargs`` go there). -> a LoadedModel with smaller FFNs."""
    if not isinstance(method, CalibratedPruning):
        raise MethodError(f"prune_model needs an offline method (WandaSP, FLAP); got {method!r}")
    cfg = model.config
    if cfg.moe is not None:
        raise MethodError(
            f"prune_model: {method.name} cannot write a pruned checkpoint of a mixture-of-experts model "
            f"({cfg.model_type}); use {type(method).__name__}(...).calibrate(model) as the method of generate instead "
            "(it prunes every expert, docs/moe.md)"
        )
    n_keep = method.n_keep(cfg)
    if n_keep == cfg.intermediate_size:
        log.warning("%s at ratio=%s prunes no channel; the model is returned unchanged", method.name, method.ratio)
        return model
    if method.selection is None:
        method = method.calibrate(model, corpus, **calibrate_kwargs)
    method.bind(cfg)  # checks the selection against the model (ratio, layers, widths)
    sel = method.selection
    uniform = len(set(sel.widths)) == 1 and sel.bias is None
    new_cfg = dataclasses.replace(
        cfg,
        intermediate_size=n_keep,  # = the mean width: the total is exactly L·n_keep
        intermediate_sizes=None if uniform else sel.widths,
        down_proj_bias=sel.bias is not None,
    )
    tree = prune_tree(checkpoint_tree(model), sel, jnp.dtype(model.dtype))
    source = f"{model.source} pruned by {method.name}(ratio={method.ratio}) on {sel.source}"
    return build_model(new_cfg, tree, model.tokenizer, source, model.dtype)


def save_pruned(model: LoadedModel, directory: str | Path) -> Path:
    """Writes ``model`` (typically from `prune_model`) as a converted popjax directory, atomically;
    ``popjax.load(directory)`` loads it. Raises FileExistsError when ``directory`` exists."""
    directory = Path(directory).expanduser()

    def save_tokenizer(target: Path) -> bool:
        if model.tokenizer is None:
            return False
        model.tokenizer.save_pretrained(str(target))
        return True

    meta = {"source": model.source, "kind": "pruned", "dtype": model.dtype}
    write_converted(directory, model.config, checkpoint_tree(model), save_tokenizer, meta)
    return directory


__all__ = ["checkpoint_tree", "prune_model", "prune_tree", "save_pruned"]
