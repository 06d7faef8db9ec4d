"""Fused expert tensors (Qwen3-VL-MoE) split into the per-expert tensors the name maps read.

transformers stores a Qwen3-VL-MoE layer's experts as two 3-D tensors,
``….mlp.experts.gate_up_proj`` and ``….mlp.experts.down_proj``, in one of two layouts:

=======================  ==============================  =============================
tensor                   transformers' module layout     hub checkpoints (transposed)
=======================  ==============================  =============================
gate_up_proj             [E, 2I, H] (gate rows, then up)  [E, H, 2I]
down_proj                [E, H, I]                        [E, I, H]
=======================  ==============================  =============================

(``save_pretrained`` writes the module layout; transformers transposes the hub's on load.)
`split_fused_experts` tells them apart by shape — H (``hidden_size``) and I
(``moe_intermediate_size``) are known from the config — and yields, for every expert e,
``….mlp.experts.{e}.{gate,up,down}_proj.weight`` in HF's per-expert ``[out, in]`` layout. A shape
that fits neither layout, or both (H = 2I for gate_up, H = I for down), is a `CheckpointError`:
guessing would load a silently wrong model.
"""

from __future__ import annotations

import re
from typing import Iterator

import numpy as np

from ..models.config import ModelConfig
from .readers import CheckpointError

_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


def _module_layout(name: str, shape: tuple[int, ...], module: tuple[int, ...], hub: tuple[int, ...]) -> bool:
    """True for transformers' module layout, False for the hub's transposed one."""
    if module == hub and shape == module:
        raise CheckpointError(f"fused expert tensor {name!r} has shape {shape}, which both layouts give for this config "
                              "(hidden_size equals the fused width): popjax cannot tell whether it is transposed")
    if shape == module:
        return True
    if shape == hub:
        return False
    raise CheckpointError(f"fused expert tensor {name!r} has shape {shape}; expected {module} (transformers' layout) "
                          f"or {hub} (the hub checkpoints' transposed layout) for this config")


def split_fused_experts(cfg: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs of a HF checkpoint -> the same, each fused expert tensor replaced by
    its per-expert tensors [out, in] (other tensors pass through unchanged)."""
    for name, array in tensors:
        match = _FUSED.fullmatch(name)
        if match is None or cfg.moe is None:
            yield name, array
            continue
        prefix, kind = match.groups()
        array = np.asarray(array)
        E, H, I = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_size
        if kind == "gate_up_proj":
            module = _module_layout(name, tuple(array.shape), (E, 2 * I, H), (E, H, 2 * I))
            fused = array if module else np.swapaxes(array, 1, 2)  # [E, 2I, H]
            for e in range(E):
                yield f"{prefix}.{e}.gate_proj.weight", fused[e, :I]
                yield f"{prefix}.{e}.up_proj.weight", fused[e, I:]
        else:
            module = _module_layout(name, tuple(array.shape), (E, H, I), (E, I, H))
            fused = array if module else np.swapaxes(array, 1, 2)  # [E, H, I]
            for e in range(E):
                yield f"{prefix}.{e}.down_proj.weight", fused[e]
