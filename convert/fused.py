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
    return out
