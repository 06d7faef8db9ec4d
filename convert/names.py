"""Explicit name maps from HF safetensors and GGUF tensor names to popjax parameter paths.

A rule maps a source-name regex to a target path template and a transform. Both sides use the
HF/PyTorch ``[out, in]`` layout. Transforms: undo llama.cpp's q/k row permutation (LLaMA GGUFs);
``plus_one`` folds Gemma's (1 + w) RMSNorm convention into the stored multiplier (HF Gemma
checkpoints store w; llama.cpp already stores 1 + w in a GGUF, so its rules add nothing).
The converted tree keeps q/k/v and gate/up apart (one entry per source tensor); the model
fuses them when it is built (`popjax.loading.build_model`).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from ..models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str  # full-match regex over the source name
    target: str  # dotted path; {0}, {1} are regex groups
    transform: str = "id"  # "id", "unpermute_q", "unpermute_k", "plus_one"


HF_RULES = (
    Rule(r"model\.embed_tokens\.weight", "embed"),
    Rule(r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{0}.attn_norm.weight"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight", "layers.{0}.attn.{1}"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.bias", "layers.{0}.attn.{1}_bias"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", "layers.{0}.attn.{1}_norm.weight"),
    Rule(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{0}.mlp_norm.weight"),
    Rule(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}"),
    # mixture of experts (models/moe.py): Qwen2-MoE / Qwen3-MoE, then Mixtral
    Rule(r"model\.layers\.(\d+)\.mlp\.gate\.weight", "layers.{0}.mlp.router"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.experts.{1}.{2}"),
    Rule(r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.shared.{1}"),
    Rule(r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", "layers.{0}.mlp.shared_gate"),
    Rule(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight", "layers.{0}.mlp.router"),
    Rule(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", "layers.{0}.mlp.experts.{1}.gate"),
    Rule(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight", "layers.{0}.mlp.experts.{1}.up"),
    Rule(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight", "layers.{0}.mlp.experts.{1}.down"),
    Rule(r"model\.norm\.weight", "final_norm.weight"),
    Rule(r"lm_head\.weight", "lm_head"),
)
# Gemma 3 (text): input / post-attention / pre-FFN / post-FFN norms around each block, norms
# stored as w with the model computing (1 + w).
GEMMA3_HF_RULES = (
    Rule(r"model\.embed_tokens\.weight", "embed"),
    Rule(r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{0}.attn_norm.weight", "plus_one"),
    Rule(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{0}.attn_post_norm.weight", "plus_one"),
    Rule(r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", "layers.{0}.mlp_norm.weight", "plus_one"),
    Rule(r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", "layers.{0}.mlp_post_norm.weight", "plus_one"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight", "layers.{0}.attn.{1}"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", "layers.{0}.attn.{1}_norm.weight", "plus_one"),
    Rule(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}"),
    Rule(r"model\.norm\.weight", "final_norm.weight", "plus_one"),
    Rule(r"lm_head\.weight", "lm_head"),
)
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the language model under Qwen2's names (as ``save_pretrained`` and the hub
# write them, or under ``model.language_model.`` as transformers 5.x names them in memory), the
# vision tower's tensors kept under their own names below ``vision.`` (models/vision_config.py reads them)
VL_HF_RULES = tuple(
    Rule(r.pattern.replace(r"model\.", r"model\.(?:language_model\.)?", 1), r.target, r.transform)
    for r in HF_RULES if ".mlp.experts" not in r.target and "router" not in r.target and "shared" not in r.target
) + (Rule(r"(?:model\.)?visual\.(.+)", "vision.{0}"),)
# Qwen3-VL-MoE: the same with the MoE rules (its fused expert tensors reach them split per expert:
# convert/fused_experts.py)
VL_MOE_HF_RULES = tuple(
    Rule(r.pattern.replace(r"model\.", r"model\.(?:language_model\.)?", 1), r.target, r.transform) for r in HF_RULES
) + (Rule(r"(?:model\.)?visual\.(.+)", "vision.{0}"),)
# Source tensors that carry no parameter (derived buffers some exporters save).
HF_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

GGUF_RULES = (
    Rule(r"token_embd\.weight", "embed"),
    Rule(r"blk\.(\d+)\.attn_norm\.weight", "layers.{0}.attn_norm.weight"),
    Rule(r"blk\.(\d+)\.attn_(q)\.weight", "layers.{0}.attn.{1}", "unpermute_q"),
    Rule(r"blk\.(\d+)\.attn_(k)\.weight", "layers.{0}.attn.{1}", "unpermute_k"),
    Rule(r"blk\.(\d+)\.attn_(v)\.weight", "layers.{0}.attn.{1}"),
    Rule(r"blk\.(\d+)\.attn_output\.weight", "layers.{0}.attn.o"),
    Rule(r"blk\.(\d+)\.attn_(q)\.bias", "layers.{0}.attn.{1}_bias", "unpermute_q"),
    Rule(r"blk\.(\d+)\.attn_(k)\.bias", "layers.{0}.attn.{1}_bias", "unpermute_k"),
    Rule(r"blk\.(\d+)\.attn_(v)\.bias", "layers.{0}.attn.{1}_bias"),
    Rule(r"blk\.(\d+)\.attn_(q|k)_norm\.weight", "layers.{0}.attn.{1}_norm.weight"),
    Rule(r"blk\.(\d+)\.ffn_norm\.weight", "layers.{0}.mlp_norm.weight"),
    Rule(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", "layers.{0}.mlp.{1}"),
    Rule(r"output_norm\.weight", "final_norm.weight"),
    Rule(r"output\.weight", "lm_head"),
)
# llama.cpp's names for MODEL_ARCH.GEMMA3 (gguf-py constants.py TENSOR_NAMES; src/llama-model.cpp
# loads these, output.weight optional = tied): ATTN_POST_NORM is "post_attention_norm", FFN_PRE_NORM
# "ffn_norm", FFN_POST_NORM "post_ffw_norm". Its converter adds 1 to every *norm.weight and permutes
# no q/k rows (only its LLaMA converter does), so every rule here is a plain rename.
GEMMA3_GGUF_RULES = (
    Rule(r"token_embd\.weight", "embed"),
    Rule(r"blk\.(\d+)\.attn_norm\.weight", "layers.{0}.attn_norm.weight"),
    Rule(r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{0}.attn_post_norm.weight"),
    Rule(r"blk\.(\d+)\.ffn_norm\.weight", "layers.{0}.mlp_norm.weight"),
    Rule(r"blk\.(\d+)\.post_ffw_norm\.weight", "layers.{0}.mlp_post_norm.weight"),
    Rule(r"blk\.(\d+)\.attn_(q|k|v)\.weight", "layers.{0}.attn.{1}"),
    Rule(r"blk\.(\d+)\.attn_output\.weight", "layers.{0}.attn.o"),
    Rule(r"blk\.(\d+)\.attn_(q|k)_norm\.weight", "layers.{0}.attn.{1}_norm.weight"),
    Rule(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", "layers.{0}.mlp.{1}"),
    Rule(r"output_norm\.weight", "final_norm.weight"),
    Rule(r"output\.weight", "lm_head"),
)
GGUF_IGNORED: tuple[str, ...] = ()

# Name maps of architectures whose tensors are named otherwise than LLaMA's.
_HF_RULES_BY_TYPE = {"gemma3_text": GEMMA3_HF_RULES, "qwen2_vl": VL_HF_RULES, "qwen2_5_vl": VL_HF_RULES, "qwen3_vl": VL_HF_RULES,
                     "qwen3_vl_moe": VL_MOE_HF_RULES}
_GGUF_RULES_BY_TYPE = {"gemma3_text": GEMMA3_GGUF_RULES}


def hf_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return _HF_RULES_BY_TYPE.get(cfg.model_type, HF_RULES)


def gguf_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return _GGUF_RULES_BY_TYPE.get(cfg.model_type, GGUF_RULES)


def match(rules: tuple[Rule, ...], name: str) -> tuple[str, str] | None:
    """Source name -> (target path, transform), or None when no rule matches."""
    for rule in rules:
        m = re.fullmatch(rule.pattern, name)
        if m:
            return rule.target.format(*m.groups()), rule.transform
    return None


def is_ignored(patterns: tuple[str, ...], name: str) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of q/k ([out, ...] with out = n_heads·h)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def apply_transform(w: np.ndarray, transform: str, cfg: ModelConfig, unpermute: bool) -> np.ndarray:
    """Applies a rule's transform; llama.cpp permutes q/k only for the LLaMA architecture."""
    if transform.startswith("unpermute_") and unpermute:
        heads = cfg.num_attention_heads if transform == "unpermute_q" else cfg.num_key_value_heads
        return _unpermute(w, heads)
    if transform == "plus_one":
        return np.asarray(w, np.float32) + np.float32(1.0)
    return w
