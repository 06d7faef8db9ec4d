"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers' configuration and weights, read from HF.

`VisionConfig` is one frozen, hashable dataclass for the three towers (a static argument of the
jitted `vision.encode_images`); `VisionConfig.from_hf` reads the ``vision_config`` block of a HF
``config.json`` (or ``Qwen2VLVisionConfig.to_dict()`` / ``Qwen2_5_VLVisionConfig.to_dict()``).
The two HF configs name the widths differently:

=================  ==========================  ====================================
VisionConfig       Qwen2-VL ``vision_config``  Qwen2.5-VL / Qwen3-VL ``vision_config``
=================  ==========================  ====================================
embed_dim (tower)  ``embed_dim``               ``hidden_size``
mlp_dim            ``embed_dim * mlp_ratio``   ``intermediate_size``
out_hidden_size    ``hidden_size`` (LM width)  ``out_hidden_size``
=================  ==========================  ====================================

Qwen3-VL's tower (models/vision.py) adds a learned position table of
``num_position_embeddings`` (a square) rows and DeepStack: the blocks ``deepstack_visual_indexes``
each feed their own merger, whose features go into the language model's first layers.

`vision_params_from_hf` turns the tower's tensors of a HF state dict into the params pytree
`vision.encode_images` reads. Weights keep the HF/PyTorch ``[out, in]`` layout (models/layers.py);
per-block tensors are stacked on a leading ``depth`` axis (the tower runs its blocks in a scan).
``save_pretrained`` in transformers 5.x and the hub checkpoints name them ``visual.…``; the
in-memory ``state_dict()`` of ``Qwen2VLForConditionalGeneration`` names them ``model.visual.…``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from .hf_fields import ConfigError  # (models/config.py imports this module: not from there)

ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# HF ``hidden_act`` names the tower's MLP may use (ACT2FN semantics); the merger always uses erf GELU
VISION_ACTIVATIONS = ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh")
_ACTIVATION_ALIASES = {"swish": "silu", "gelu_new": "gelu_pytorch_tanh", "gelu_tanh": "gelu_pytorch_tanh"}
# vision_config ``model_type`` values -> the architecture they belong to (old Qwen2-VL saves say "qwen2_vl")
_MODEL_TYPES = {"qwen2_vl_vision": "qwen2_vl", "qwen2_vl": "qwen2_vl", "qwen2_5_vl_vision": "qwen2_5_vl", "qwen2_5_vl": "qwen2_5_vl",
                "qwen3_vl_vision": "qwen3_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe_vision": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl"}
NORM_EPS = 1e-6  # every tower hard-codes eps=1e-6 (LayerNorm in Qwen2-VL and Qwen3-VL, RMSNorm in Qwen2.5-VL)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Vision tower hyper-parameters. E = embed_dim, F = mlp_dim, O = out_hidden_size."""

    architecture: str  # "qwen2_vl" (LayerNorm, fc1/fc2 MLP), "qwen2_5_vl" (RMSNorm, gated MLP, windows) or "qwen3_vl"
    depth: int
    embed_dim: int
    num_heads: int
    mlp_dim: int
    out_hidden_size: int
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    window_size: int = 0  # Qwen2.5-VL: window side in pixels; 0 = no window attention (Qwen2-VL)
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: blocks with full (per-frame) attention
    # Qwen3-VL: rows of the learned position table (a square side²) and the blocks whose outputs
    # DeepStack merges into the language model (models/vision.py); 0 and () elsewhere
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one pixel_values row: in_channels · temporal_patch_size · patch_size²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token (spatial_merge_size²)."""
        return self.spatial_merge_size**2

    @property
    def merger_dim(self) -> int:
        return self.embed_dim * self.merge_unit

    @property
    def windowed(self) -> bool:
        return self.architecture == "qwen2_5_vl"

    @property
    def window_tokens(self) -> int:
        """Window side in merged tokens (HF's ``vit_merger_window_size``)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def is_qwen3(self) -> bool:
        """Qwen3-VL's tower: biased patch embedding, learned positions, DeepStack mergers."""
        return self.architecture == "qwen3_vl"

    @property
    def position_side(self) -> int:
        """Side of Qwen3-VL's square learned position table (0 without one)."""
        return int(round(self.num_position_embeddings**0.5))

    def full_attention(self, block: int) -> bool:
        """Whether block ``block`` attends over its whole frame (else within its window)."""
        return not self.windowed or block in self.fullatt_block_indexes

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], architecture: str) -> "VisionConfig":
        """The HF ``vision_config`` dict of a ``architecture`` ("qwen2_vl" / "qwen2_5_vl") model.

        The width fields (depth, widths, heads, output size) are required; the others default as
        HF's config classes do. A missing or invalid field is one `ConfigError` naming it."""
        if architecture not in ARCHITECTURES:
            raise ConfigError(f"vision architecture={architecture!r} is not one popjax runs; supported: {list(ARCHITECTURES)}")
        if not isinstance(raw, Mapping):
            raise ConfigError(f"vision_config must be a mapping of HF fields, got {type(raw).__name__}")
        declared = _MODEL_TYPES.get(raw.get("model_type"))
        if declared is not None and declared != architecture:
            raise ConfigError(f"vision_config model_type={raw['model_type']!r} is a {declared} tower, not {architecture}")
        two_five, three = architecture == "qwen2_5_vl", architecture == "qwen3_vl"
        width_key, out_key = ("hidden_size", "out_hidden_size") if two_five or three else ("embed_dim", "hidden_size")
        depth = _positive_int(raw, "depth")
        embed_dim = _positive_int(raw, width_key)
        num_heads = _positive_int(raw, "num_heads")
        out_hidden_size = _positive_int(raw, out_key)
        if two_five or three:
            mlp_dim = _positive_int(raw, "intermediate_size")
        else:
            ratio = raw.get("mlp_ratio", 4)
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or int(embed_dim * ratio) < 1:
                raise ConfigError(f"vision_config mlp_ratio={ratio!r} is invalid: give a positive number")
            mlp_dim = int(embed_dim * ratio)
        if embed_dim % num_heads or (embed_dim // num_heads) % 4:
            raise ConfigError(
                f"vision_config {width_key}={embed_dim} with num_heads={num_heads} is invalid: the head size "
                "must be a whole multiple of 4 (the 2-D rotary splits it into h and w halves of cos/sin pairs)"
            )
        act = raw.get("hidden_act", "silu" if two_five else "gelu_pytorch_tanh" if three else "quick_gelu")
        act = _ACTIVATION_ALIASES.get(act, act)
        if act not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config hidden_act={act!r} is not supported; supported: {list(VISION_ACTIVATIONS)}")
        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"vision_config rope_parameters={rope!r} is invalid: give a mapping")
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config rope_parameters.rope_type={rope.get('rope_type')!r} is invalid: the tower's rotary is 'axial'")
        theta = rope.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ConfigError(f"vision_config rope_parameters.rope_theta={theta!r} is invalid: give a positive number")
        channels_key = "in_channels" if "in_channels" in raw or "in_chans" not in raw else "in_chans"
        fields = dict(
            architecture=architecture, depth=depth, embed_dim=embed_dim, num_heads=num_heads, mlp_dim=mlp_dim,
            out_hidden_size=out_hidden_size, hidden_act=act, rope_theta=float(theta),
            in_channels=_positive_int(raw, channels_key, 3),
            patch_size=_positive_int(raw, "patch_size", 16 if three else 14),
            temporal_patch_size=_positive_int(raw, "temporal_patch_size", 2),
            spatial_merge_size=_positive_int(raw, "spatial_merge_size", 2),
        )
        if two_five:
            window = _positive_int(raw, "window_size", 112)
            unit = fields["patch_size"] * fields["spatial_merge_size"]
            if window < unit:
                raise ConfigError(
                    f"vision_config window_size={window} is invalid: a window must span at least one merged token "
                    f"(patch_size·spatial_merge_size = {unit} pixels)"
                )
            full = raw.get("fullatt_block_indexes", (7, 15, 23, 31))
            if not isinstance(full, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in full):
                raise ConfigError(f"vision_config fullatt_block_indexes={full!r} is invalid: give a list of block indexes ≥ 0")
            # indexes ≥ depth are kept, as HF does: they never match a block (tiny test configs have them)
            fields.update(window_size=window, fullatt_block_indexes=tuple(sorted(set(full))))
        if three:
            fields.update(_qwen3_fields(raw, depth))
        return cls(**fields)


    def to_dict(self) -> dict[str, Any]:
        """The HF ``vision_config`` block of this tower (`from_hf` reads it back to an equal config)."""
        out: dict[str, Any] = dict(
            model_type=f"{self.architecture}_vision", depth=self.depth, num_heads=self.num_heads,
            hidden_act=self.hidden_act, in_channels=self.in_channels, patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size, spatial_merge_size=self.spatial_merge_size,
            rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta},
        )
        if self.windowed or self.is_qwen3:
            out.update(hidden_size=self.embed_dim, intermediate_size=self.mlp_dim, out_hidden_size=self.out_hidden_size)
        if self.windowed:
            out.update(window_size=self.window_size, fullatt_block_indexes=list(self.fullatt_block_indexes))
        elif self.is_qwen3:
            out.update(num_position_embeddings=self.num_position_embeddings,
                       deepstack_visual_indexes=list(self.deepstack_visual_indexes))
        else:
            ratio: float = self.mlp_dim // self.embed_dim if self.mlp_dim % self.embed_dim == 0 else self.mlp_dim / self.embed_dim
            while int(self.embed_dim * ratio) < self.mlp_dim:  # HF truncates embed_dim·mlp_ratio
                ratio = float(np.nextafter(ratio, np.inf))
            out.update(embed_dim=self.embed_dim, hidden_size=self.out_hidden_size, mlp_ratio=ratio)
        return out


def _qwen3_fields(raw: Mapping[str, Any], depth: int) -> dict[str, Any]:
    """Qwen3-VL's own ``vision_config`` fields: the position table's size (a perfect square:
    HF resamples it as a side×side grid) and the DeepStack blocks (distinct, below ``depth``,
    kept in the given order: block ``indexes[j]`` runs merger j; the features reach decoder
    layers in ascending block order, as HF collects them)."""
    n = _positive_int(raw, "num_position_embeddings", 2304)
    side = int(round(n**0.5))
    if side * side != n or side < 2:
        raise ConfigError(f"vision_config num_position_embeddings={n} is invalid: give a square of a side ≥ 2 (e.g. 48² = 2304)")
    deep = raw.get("deepstack_visual_indexes", (8, 16, 24))
    if not isinstance(deep, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth for i in deep) \
            or len(set(deep)) != len(deep):
        raise ConfigError(f"vision_config deepstack_visual_indexes={deep!r} is invalid: give distinct block indexes in [0, depth={depth})")
    return dict(num_position_embeddings=n, deepstack_visual_indexes=tuple(deep))


def vision_from_dict(raw: Mapping[str, Any], architecture: str) -> VisionConfig:
    """`VisionConfig.from_hf` as a function (what models/config.py calls)."""
    return VisionConfig.from_hf(raw, architecture)


def _positive_int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    if key not in raw and default is None:
        raise ConfigError(f"vision_config has no {key!r} field (required)")
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"vision_config {key}={value!r} is invalid: give an integer ≥ 1")
    return value


# The params pytree: {"patch_embed": [E, patch_dim], "blocks": {name: [depth, ...]}, "merger": {name: ...}}
# Each entry: (our name, HF name after the block/merger prefix, shape of one block's tensor)
def _block_tensors(cfg: VisionConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    e, f = cfg.embed_dim, cfg.mlp_dim
    norms = [("norm1_w", "norm1.weight", (e,)), ("norm2_w", "norm2.weight", (e,))]
    if not cfg.windowed:  # Qwen2-VL's LayerNorms have biases; Qwen2.5-VL's RMSNorms do not
        norms += [("norm1_b", "norm1.bias", (e,)), ("norm2_b", "norm2.bias", (e,))]
    attn = [
        ("qkv_w", "attn.qkv.weight", (3 * e, e)), ("qkv_b", "attn.qkv.bias", (3 * e,)),
        ("proj_w", "attn.proj.weight", (e, e)), ("proj_b", "attn.proj.bias", (e,)),
    ]
    if cfg.windowed:
        mlp = [
            ("gate_w", "mlp.gate_proj.weight", (f, e)), ("gate_b", "mlp.gate_proj.bias", (f,)),
            ("up_w", "mlp.up_proj.weight", (f, e)), ("up_b", "mlp.up_proj.bias", (f,)),
            ("down_w", "mlp.down_proj.weight", (e, f)), ("down_b", "mlp.down_proj.bias", (e,)),
        ]
    else:  # Qwen2-VL's fc1/fc2 and Qwen3-VL's linear_fc1/linear_fc2: one ungated MLP
        fc = "linear_fc" if cfg.is_qwen3 else "fc"
        mlp = [
            ("fc1_w", f"mlp.{fc}1.weight", (f, e)), ("fc1_b", f"mlp.{fc}1.bias", (f,)),
            ("fc2_w", f"mlp.{fc}2.weight", (e, f)), ("fc2_b", f"mlp.{fc}2.bias", (e,)),
        ]
    return norms + attn + mlp


def _merger_tensors(cfg: VisionConfig, postshuffle: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """The patch merger's tensors; Qwen3-VL names them norm / linear_fc1 / linear_fc2, and its
    DeepStack mergers (``postshuffle``) normalise the merged [merger_dim] rows instead."""
    m = cfg.merger_dim
    if cfg.is_qwen3:
        width = m if postshuffle else cfg.embed_dim
        return [
            ("ln_q_w", "norm.weight", (width,)), ("ln_q_b", "norm.bias", (width,)),
            ("mlp0_w", "linear_fc1.weight", (m, m)), ("mlp0_b", "linear_fc1.bias", (m,)),
            ("mlp2_w", "linear_fc2.weight", (cfg.out_hidden_size, m)), ("mlp2_b", "linear_fc2.bias", (cfg.out_hidden_size,)),
        ]
    norm = [("ln_q_w", "ln_q.weight", (cfg.embed_dim,))]
    if not cfg.windowed:
        norm.append(("ln_q_b", "ln_q.bias", (cfg.embed_dim,)))
    return norm + [
        ("mlp0_w", "mlp.0.weight", (m, m)), ("mlp0_b", "mlp.0.bias", (m,)),
        ("mlp2_w", "mlp.2.weight", (cfg.out_hidden_size, m)), ("mlp2_b", "mlp.2.bias", (cfg.out_hidden_size,)),
    ]


def _patch_embed_shape(cfg: VisionConfig) -> tuple[int, ...]:
    return (cfg.embed_dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)


def vision_tensor_names(cfg: VisionConfig, prefix: str = "visual.") -> tuple[str, ...]:
    """Every HF tensor name the tower reads (``prefix`` + ``patch_embed.proj.weight``,
    ``blocks.{i}.…``, ``merger.…``), so a converter can pick them out of a checkpoint."""
    return tuple(vision_tensor_shapes(cfg, prefix))


def vision_tensor_shapes(cfg: VisionConfig, prefix: str = "visual.") -> dict[str, tuple[int, ...]]:
    """Each HF tensor name the tower reads (`vision_tensor_names`) -> its shape."""
    shapes = {f"{prefix}patch_embed.proj.weight": _patch_embed_shape(cfg)}
    if cfg.is_qwen3:  # a biased Conv3d and the learned position table
        shapes.update({f"{prefix}patch_embed.proj.bias": (cfg.embed_dim,),
                       f"{prefix}pos_embed.weight": (cfg.num_position_embeddings, cfg.embed_dim)})
    for i in range(cfg.depth):
        shapes.update({f"{prefix}blocks.{i}.{hf}": shape for _, hf, shape in _block_tensors(cfg)})
    shapes.update({f"{prefix}merger.{hf}": shape for _, hf, shape in _merger_tensors(cfg)})
    for j in range(len(cfg.deepstack_visual_indexes)):
        shapes.update({f"{prefix}deepstack_merger_list.{j}.{hf}": shape for _, hf, shape in _merger_tensors(cfg, True)})
    return shapes


def _detect_prefix(tensors: Mapping[str, Any]) -> str:
    for prefix in ("visual.", "model.visual."):
        if f"{prefix}patch_embed.proj.weight" in tensors:
            return prefix
    raise ConfigError("no vision tower tensors: neither 'visual.patch_embed.proj.weight' nor 'model.visual.patch_embed.proj.weight' is present")


def vision_params_from_hf(
    tensors: Mapping[str, Any], cfg: VisionConfig, prefix: str | None = None, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """The params pytree from HF tensors (NumPy arrays, or anything ``np.asarray`` reads).

    ``prefix`` None finds ``visual.`` (saved checkpoints) or ``model.visual.`` (an in-memory
    ``state_dict()``). A missing tensor or one of the wrong shape is a `ConfigError` naming it.
    Returns {"patch_embed": [E, patch_dim] (the Conv3d kernel flattened in pixel_values' (C, t, p, p)
    order), "blocks": {name: [depth, …]}, "merger": {name: …}}, every array in ``dtype``; a Qwen3-VL
    tower adds "patch_bias" [E], "pos_embed" [P, E] and "deepstack" {name: [n_deep, …]}."""
    prefix = _detect_prefix(tensors) if prefix is None else prefix

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ConfigError(f"vision tower tensor {name!r} is missing from the checkpoint")
        value = np.asarray(tensors[name])
        if value.shape != shape:
            raise ConfigError(f"vision tower tensor {name!r} has shape {value.shape}, expected {shape} for this config")
        return value.astype(np.float32)

    patch = read(f"{prefix}patch_embed.proj.weight", _patch_embed_shape(cfg)).reshape(cfg.embed_dim, cfg.patch_dim)
    blocks = {
        ours: np.stack([read(f"{prefix}blocks.{i}.{hf}", shape) for i in range(cfg.depth)])
        for ours, hf, shape in _block_tensors(cfg)
    }
    merger = {ours: read(f"{prefix}merger.{hf}", shape) for ours, hf, shape in _merger_tensors(cfg)}
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    out = {
        "patch_embed": cast(patch),
        "blocks": {k: cast(v) for k, v in blocks.items()},
        "merger": {k: cast(v) for k, v in merger.items()},
    }
    if cfg.is_qwen3:  # deepstack: each merger's tensors stacked on a leading [n_deep] axis
        out["patch_bias"] = cast(read(f"{prefix}patch_embed.proj.bias", (cfg.embed_dim,)))
        out["pos_embed"] = cast(read(f"{prefix}pos_embed.weight", (cfg.num_position_embeddings, cfg.embed_dim)))
        n = len(cfg.deepstack_visual_indexes)
        out["deepstack"] = {
            ours: cast(np.stack([read(f"{prefix}deepstack_merger_list.{j}.{hf}", shape) for j in range(n)]) if n
                       else np.zeros((0, *shape), np.float32))
            for ours, hf, shape in _merger_tensors(cfg, True)
        }
    return out


def vision_tensors_to_hf(params: Mapping[str, Any], cfg: VisionConfig, prefix: str = "vision.") -> dict[str, np.ndarray]:
    """The inverse of `vision_params_from_hf`: the params pytree -> {``prefix`` + HF name: NumPy
    array} (the Conv3d kernel unflattened, the blocks unstacked)."""
    out = {f"{prefix}patch_embed.proj.weight": np.asarray(params["patch_embed"], np.float32).reshape(_patch_embed_shape(cfg))}
    for ours, hf, _ in _block_tensors(cfg):
        stacked = np.asarray(params["blocks"][ours], np.float32)
        out.update({f"{prefix}blocks.{i}.{hf}": stacked[i] for i in range(cfg.depth)})
    out.update({f"{prefix}merger.{hf}": np.asarray(params["merger"][ours], np.float32) for ours, hf, _ in _merger_tensors(cfg)})
    if cfg.is_qwen3:
        out[f"{prefix}patch_embed.proj.bias"] = np.asarray(params["patch_bias"], np.float32)
        out[f"{prefix}pos_embed.weight"] = np.asarray(params["pos_embed"], np.float32)
        for ours, hf, _ in _merger_tensors(cfg, True):
            stacked = np.asarray(params["deepstack"][ours], np.float32)
            out.update({f"{prefix}deepstack_merger_list.{j}.{hf}": stacked[j] for j in range(len(stacked))})
    return out

