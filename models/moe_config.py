"""The mixture-of-experts part of a model's configuration (Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE's
language model, Mixtral):
`MoEConfig`, and `moe_from_hf`, which reads it from a HF ``config.json``. The MoE layers
themselves are in models/moe.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from .hf_fields import ConfigError

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "qwen3_vl_moe")
# families whose router always renormalises its top-k probabilities (their configs carry no
# norm_topk_prob: transformers' Qwen3VLMoeTextTopKRouter divides by their sum unconditionally)
_ALWAYS_RENORMALISED = ("mixtral", "qwen3_vl_moe")
EXPERT_ACTIVATIONS = ("silu",)  # gated SiLU experts, the only kind pruning is defined for
# HF router fields some MoE families carry; anything but these values changes the routing.
ROUTER_FIELDS = {"scoring_func": ("softmax",), "topk_method": ("greedy",)}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The MoE part of a ModelConfig (frozen, hashable: part of the jit static config)."""

    num_experts: int  # E routed experts per sparse layer
    top_k: int  # experts per token
    expert_size: int  # f_e
    dense_size: int  # FFN width of a layer without experts (HF intermediate_size)
    shared_size: int = 0  # f_s of the shared expert, 0 = none
    shared_gate: bool = False  # sigmoid(x · w_g) scales the shared expert (Qwen2-MoE)
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...] = ()  # layers with routed experts

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def always_width(self, layer: int) -> int:
        """Width of the always-active FFN of a layer: the shared expert or the dense FFN."""
        return self.shared_size if self.is_sparse(layer) else self.dense_size

    def blocks(self, width: int) -> int:
        return math.ceil(width / self.expert_size)

    def slots(self, n_layers: int) -> int:
        """Block slots per layer for per-block constants (calibration tables ``[L, slots, ...]``):
        routed expert e is slot e, always-active block b is slot ``num_experts + b``."""
        return self.num_experts + max(self.blocks(self.always_width(l)) for l in range(n_layers))

    def slot_mask(self, n_layers: int) -> np.ndarray:
        """[L, slots] bool: which slots hold a block in each layer (a dense layer has no experts;
        layers have different numbers of always-active blocks)."""
        mask = np.zeros((n_layers, self.slots(n_layers)), bool)
        for l in range(n_layers):
            mask[l, : self.num_experts] = self.is_sparse(l)
            mask[l, self.num_experts : self.num_experts + self.blocks(self.always_width(l))] = True
        return mask

    def activated_mlp_params(self, d: int, n_layers: int) -> int:
        """FFN parameters a token activates, summed over layers: top-k experts + shared expert
        in sparse layers, the dense FFN elsewhere (router and shared gate excluded)."""
        total = 0
        for layer in range(n_layers):
            width = self.top_k * self.expert_size + self.shared_size if self.is_sparse(layer) else self.dense_size
            total += 3 * d * width
        return total

    def hf_fields(self, model_type: str, n_layers: int) -> dict[str, Any]:
        """HF config.json fields that `moe_from_hf` reads back to this config."""
        out = {
            "num_experts_per_tok": self.top_k,
            "intermediate_size": self.expert_size if model_type == "mixtral" else self.dense_size,
        }
        if model_type == "mixtral":
            return {**out, "num_local_experts": self.num_experts}
        return {
            **out,
            "num_experts": self.num_experts,
            "moe_intermediate_size": self.expert_size,
            "shared_expert_intermediate_size": self.shared_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(n_layers) if i not in self.sparse_layers],
        }


def moe_from_hf(raw: Mapping[str, Any], model_type: str, n_layers: int) -> MoEConfig:
    """The MoE fields of a HF config.json (Qwen2-MoE, Qwen3-MoE or Mixtral) -> MoEConfig."""
    act = raw.get("hidden_act", "silu")
    if act not in EXPERT_ACTIVATIONS:
        raise ConfigError(f"expert type hidden_act={act!r} is not supported; supported: {list(EXPERT_ACTIVATIONS)}")
    for key, allowed in ROUTER_FIELDS.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"router type {key}={raw[key]!r} is not supported; supported: {list(allowed)}")
    n_experts = raw.get("num_local_experts") if model_type == "mixtral" else None
    n_experts = n_experts if n_experts is not None else raw.get("num_experts", raw.get("num_local_experts"))
    top_k = raw.get("num_experts_per_tok")
    for key, value in (("num_experts", n_experts), ("num_experts_per_tok", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} is invalid for {model_type}: give an integer ≥ 1")
    if top_k > n_experts:
        raise ConfigError(f"num_experts_per_tok={top_k} exceeds num_experts={n_experts}: a token cannot pick more experts than exist")
    dense = int(raw["intermediate_size"])
    if model_type == "mixtral":
        return MoEConfig(n_experts, top_k, dense, dense, norm_topk_prob=True, sparse_layers=tuple(range(n_layers)))
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    only = raw.get("mlp_only_layers") or []
    bad = [i for i in only if not (isinstance(i, int) and 0 <= i < n_layers)]
    if bad:
        raise ConfigError(f"mlp_only_layers={only!r} holds {bad}, not layer indices in [0, {n_layers})")
    sparse = tuple(i for i in range(n_layers) if i not in only and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
    return MoEConfig(
        num_experts=n_experts,
        top_k=top_k,
        expert_size=int(raw["moe_intermediate_size"]),
        dense_size=dense,
        shared_size=shared,
        shared_gate=shared > 0,
        norm_topk_prob=model_type in _ALWAYS_RENORMALISED or bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
