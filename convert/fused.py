"""The fused layout: what converted checkpoints store (format 5) and the modules read.

A source checkpoint (HF or GGUF) names q/k/v and gate/up apart. The modules read them fused:
``attn.qkv`` = q/k/v grouped by KV head ([n_kv, g + 2, h, d]: each KV group's g query heads, its
key head, its value head; so splitting n_kv over a mesh keeps whole groups on one device),
``attn.qkv_bias`` likewise ([n_kv, g + 2, h]), and
``mlp.gate_up`` = gate and up stacked on a leading axis ([2, f, d], so that splitting f over a
mesh leaves each device matching gate and up rows); a MoE layer's FFN is its stacked blocks
(models/moe.py). Storing this layout means a load with a mesh restores every tensor straight
into its sharding (orbax reads each device's block from disk; popjax.sharding.RULES), with no
fusion on the host and no full copy anywhere first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..models.config import ModelConfig
from ..models.layers import fuse_qkv
from ..models.moe import fuse_layer as fuse_moe_layer
from ..kernels.int8 import quantize

# The linear layers an int8 model stores as int8 with per-output-channel scales (popjax/kernels/int8.py):
# attention q/k/v and o, the FFN's gate/up and down (a MoE model's expert blocks too), and the
# token embedding / LM head (a scale per token row). Norms, biases and the router stay float.
INT8_LINEARS = ("qkv", "o", "gate_up", "down")
INT8_EMBEDDINGS = ("embed", "lm_head")


def fuse_checkpoint(cfg: ModelConfig, tree: dict[str, Any]) -> dict[str, Any]:
    """Converted checkpoint tree (HF layout, q/k/v and gate/up apart) -> the module's tree
    (``attn.qkv``, ``attn.qkv_bias``, ``mlp.gate_up``), with str layer keys."""
    out = {k: v for k, v in tree.items() if k != "layers"}
    out["layers"] = {}
    for key, layer in tree["layers"].items():
        attn = dict(layer["attn"])
        fused_attn = {"qkv": fuse_qkv(attn.pop("q"), attn.pop("k"), attn.pop("v"), cfg)}
        if cfg.qkv_bias:
            fused_attn["qkv_bias"] = fuse_qkv(attn.pop("q_bias"), attn.pop("k_bias"), attn.pop("v_bias"), cfg)
        mlp = layer["mlp"]
        if cfg.moe is not None:  # stacked expert blocks (models/moe.py)
            fused_mlp = fuse_moe_layer(cfg, int(key), mlp)
        else:
            fused_mlp = {"gate_up": np.stack([mlp["gate"], mlp["up"]]), "down": mlp["down"]}
        if "down_bias" in mlp:  # a FLAP-pruned checkpoint (popjax.pruned)
            fused_mlp["down_bias"] = mlp["down_bias"]
        out["layers"][str(key)] = {
            **{k: v for k, v in layer.items() if k not in ("attn", "mlp")},
            "attn": {**attn, **fused_attn},
            "mlp": fused_mlp,
        }
    return quantize_linears(out) if cfg.weights == "int8" else out


def quantize_linears(tree: dict[str, Any]) -> dict[str, Any]:
    """A fused tree -> the same tree with every `INT8_LINEARS` weight of its layers as int8
    ``name`` plus fp32 ``name_scale`` [..., 1] (`kernels.int8.quantize`, from the float values)."""

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out[key] = walk(value)
            elif key in INT8_LINEARS:
                out[key], out[f"{key}_scale"] = quantize(value)
            else:
                out[key] = value
        return out

    out = {**tree, "layers": {key: walk(layer) for key, layer in tree["layers"].items()}}
    for key in INT8_EMBEDDINGS:
        if key in tree:
            out[key], out[f"{key}_scale"] = quantize(tree[key])
    return out


def dequantize_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `quantize_linears` up to rounding: every int8 ``name`` with a
    ``name_scale`` sibling -> the float32 array q · s (scales dropped); other leaves unchanged."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = dequantize_tree(value)
        elif f"{key}_scale" in tree:
            out[key] = np.asarray(value, np.float32) * np.asarray(tree[f"{key}_scale"], np.float32)
        elif not (str(key).endswith("_scale") and str(key)[: -len("_scale")] in tree):
            out[key] = value
    return out
