"""Gemma 3 from llama.cpp GGUF files (architecture "gemma3", written by tests/gguf_files.py the way
llama.cpp's converter writes them) and from a Hugging Face hub id: the config each yields, parity
with transformers (fp32; a left-padded prefill and 8 teacher-forced decode steps past the window),
F16 / Q8_0 files, and bad files (one-line errors, nothing left in the cache)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from huggingface_hub import constants

import popjax
from popjax import cache
from popjax.convert import CheckpointError, readers
from popjax.models import ConfigError
from popjax.models.config import ModelConfig
from tests.reference.parity import hf_logits, parity_errors
from tests.gguf_files import dequantized_model, period_layer_types, tiny_gemma3, write_gemma3_gguf, write_metadata_only

ATOL = 1e-4
# tests/models/test_parity.py's protocol: prompts of 5, 9 and 13 tokens and 8 decode steps, up to 21
# positions, past both windows (8 and 6)

# name -> (Gemma3TextConfig fields on top of TINY_BASE, write_gemma3_gguf options). Only layer
# patterns a GGUF can state: llama.cpp's period 6 (no key; 7 layers: 0-4 slide, 5 full, 6 slides),
# or a period it is given (2: slide, full, slide). query_pre_attn_scalar = head_dim, the scale
# llama.cpp derives for every size but the 27B.
CASES = {
    "period6-tied": (
        dict(num_hidden_layers=7, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
             tie_word_embeddings=True, layer_types=period_layer_types(7)),
        dict(),
    ),
    # untied head, linear RoPE scaling of the global layers, a local base of its own (stated by
    # rope.freq_base_swa), final soft-capping, one KV head
    "period2-untied": (
        dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
             tie_word_embeddings=False, final_logit_softcapping=5.0, layer_types=period_layer_types(3, 2),
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}),
        dict(pattern=2, swa_rope_key=True),
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (HF checkpoint dir, torch model), each built once per module."""
    made = {}

    def get(name: str):
        if name not in made:
            directory = tmp_path_factory.mktemp(name)
            made[name] = (directory, tiny_gemma3(directory, **CASES[name][0]))
        return made[name]

    return get


@pytest.fixture(scope="module")
def gguf_file(tiny, tmp_path_factory):
    """(name, file type) -> path of the GGUF llama.cpp's converter would write, once per module."""
    made = {}

    def get(name: str, file_type: str = "F32"):
        if (name, file_type) not in made:
            _, hf_model = tiny(name)
            path = tmp_path_factory.mktemp("gguf") / f"{name}.{file_type}.gguf"
            made[name, file_type] = write_gemma3_gguf(hf_model, path, file_type, **CASES[name][1])
        return made[name, file_type]

    return get


def config_differences(a: ModelConfig, b: ModelConfig, skip=()) -> dict:
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
            if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)}


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_from_gguf_equals_the_hf_config(name, tiny, gguf_file):
    """Every field: layer types, window, local RoPE base, scaling, attention scale, soft-cap, GeGLU, ..."""
    directory, _ = tiny(name)
    path = gguf_file(name)
    ours = readers.gguf_config(readers.open_gguf(path), path)
    assert config_differences(ours, ModelConfig.from_json(directory / "config.json")) == {}
    assert ours.model_type == "gemma3_text" and ours.hidden_act == "gelu_pytorch_tanh" and "sliding_attention" in ours.layer_types


# The released configs (HF config.json, transformers 4.5x layout) of the sizes whose GGUFs matter
# most: the 270M (head_dim 256 = query_pre_attn_scalar) and the 27B (query_pre_attn_scalar 168 =
# 5376 / 32, which llama.cpp derives from the layer count 62; linear RoPE scaling 8).
REAL_SIZES = {
    "gemma-3-270m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                         max_position_embeddings=32768, rope_scaling=None, tie_word_embeddings=True),
    "gemma-3-27b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
                        max_position_embeddings=131072, rope_scaling={"rope_type": "linear", "factor": 8.0},
                        tie_word_embeddings=True),
}


@pytest.mark.parametrize("size", sorted(REAL_SIZES))
def test_config_of_released_sizes_from_gguf_metadata(size, tmp_path):
    import transformers

    raw = dict(REAL_SIZES[size], model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
               rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6, vocab_size=262144,
               final_logit_softcapping=None, attn_logit_softcapping=None)
    hf = ModelConfig.from_hf_dict(raw)
    path = write_metadata_only(transformers.Gemma3TextConfig(**raw), tmp_path / f"{size}.gguf")
    ours = readers.gguf_config(readers.open_gguf(path), path)
    # the stand-in embedding has 8 rows; no tokenizer, so no special ids
    assert config_differences(ours, hf, skip=("vocab_size", "bos_token_id", "eos_token_ids")) == {}
    assert ours.query_pre_attn_scalar == raw["query_pre_attn_scalar"]


@pytest.mark.parametrize(
    "window, pattern, full_layers",
    [
        (512, None, [5, 11, 17]),  # no key: llama.cpp's period 6
        (512, 3, [2, 5, 8, 11, 14, 17]),  # a period
        (512, [i % 4 != 0 for i in range(18)], [0, 4, 8, 12, 16]),  # one bool per layer, true = sliding
        (0, None, list(range(18))),  # window 0: every layer full (llama.cpp: swa_type NONE)
    ],
)
def test_layer_pattern_forms_in_gguf_metadata(window, pattern, full_layers, tmp_path):
    import transformers

    cfg = transformers.Gemma3TextConfig(**dict(REAL_SIZES["gemma-3-270m"], sliding_window=window))
    path = write_metadata_only(cfg, tmp_path / "m.gguf", pattern=pattern)
    ours = readers.gguf_config(readers.open_gguf(path), path)
    kinds = ours.layer_types or ("full_attention",) * 18
    assert [i for i, kind in enumerate(kinds) if kind == "full_attention"] == full_layers
    assert ours.sliding_window == (window or None)


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("name", sorted(CASES))
def test_f32_gguf_matches_transformers(name, tiny, gguf_file):
    _, hf_model = tiny(name)
    model = popjax.load(gguf_file(name), dtype="float32", cache=False)
    prefill, decode = parity_errors(model, hf_model)
    assert prefill < ATOL and decode < ATOL, (prefill, decode)


# F16 and Q8_0: against transformers holding the very values the file stores (dequantized), the
# fp32 bound holds (measured ~3e-6). Against the original model the format's rounding shows: F16
# keeps 11 significant bits (≤ 2^-11 ≈ 5e-4 relative per weight), Q8_0 rounds each weight to a step
# of max|w| / 127 over its block of 32 (~0.6% rms of a Gaussian block); through 7 layers of these
# tiny random models (|logits| ≲ 3) that measured 4.8e-3 (F16) and 0.13 (Q8_0) as the largest
# logit / log-prob change. The bounds leave ~4x and ~2x margin, and the lower bound 0 checks the
# file really is quantized.
QUANT_BOUNDS = {"F16": 2e-2, "Q8_0": 0.25}


@pytest.mark.parametrize("file_type", sorted(QUANT_BOUNDS))
def test_quantized_gguf_matches_its_dequantized_weights(file_type, tiny, gguf_file):
    _, hf_model = tiny("period6-tied")
    path = gguf_file("period6-tied", file_type)
    assert {t.tensor_type.name for t in readers.open_gguf(path).tensors} == {file_type, "F32"}  # norms stay F32
    model = popjax.load(path, dtype="float32", cache=False)
    prefill, decode = parity_errors(model, dequantized_model(hf_model, path))
    assert prefill < ATOL and decode < ATOL, (prefill, decode)
    off = parity_errors(model, hf_model)
    assert 0 < max(off) < QUANT_BOUNDS[file_type], off


def test_gguf_tokenizer(gguf_file):
    """transformers builds Gemma files' tokenizers with its own gemma builder (merges from token order)."""
    tok = popjax.load(gguf_file("period6-tied"), dtype="float32", cache=False).tokenizer
    ids = tok("hello world, the cat sat")["input_ids"]
    assert ids[0] == 1 and len(ids) == 7  # <bos>, then whole words from the merges
    assert tok.decode(ids, skip_special_tokens=True) == "hello world, the cat sat"


# ------------------------------------------------------------------ bad files


def _drop(name):
    return dict(drop=(name,))


BAD_FILES = {
    "missing-norm": (_drop("blk.6.post_ffw_norm.weight"), CheckpointError,
                     r"lacks 1 parameter\(s\): layers\.6\.mlp_post_norm\.weight"),
    "missing-embedding": (_drop("token_embd.weight"), CheckpointError, r"lacks the tensor 'token_embd\.weight'"),
    "misshaped": (dict(replace={"blk.0.ffn_down.weight": np.zeros((64, 64), np.float32)}), CheckpointError,
                  r"'blk\.0\.ffn_down\.weight' .* shape \(64, 64\).*expected \(64, 96\)"),
    "unknown-architecture": (dict(arch="gemma2"), ConfigError,
                             r"unsupported architecture general\.architecture='gemma2'.*supported: \[.*'gemma3'"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_gguf_is_a_one_line_error_and_leaves_no_cache_entry(case, tiny, tmp_path, monkeypatch):
    options, error, message = BAD_FILES[case]
    _, hf_model = tiny("period6-tied")
    path = write_gemma3_gguf(hf_model, tmp_path / f"{case}.gguf", **options)
    root = tmp_path / "cache"
    monkeypatch.setenv("POPJAX_CACHE", str(root))
    with pytest.raises(error, match=message) as err:
        popjax.load(path, dtype="float32")  # the cache on: the conversion runs inside its entry
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert cache.list_entries(root) == []
    converted = root / "converted"  # neither an entry nor a temp dir (a free lock file may stay)
    assert not converted.exists() or [p.name for p in converted.iterdir() if not p.name.endswith(".lock")] == []


# ------------------------------------------------------------------ hub id

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def released_layout(config: dict) -> dict:
    """A transformers 5.x Gemma 3 config.json in the layout of the released google/gemma-3-270m
    (transformers 4.5x: rope_theta / rope_local_base_freq / rope_scaling, _sliding_window_pattern)."""
    rope = config.pop("rope_parameters")
    return {**config, "architectures": ["Gemma3ForCausalLM"], "rope_theta": rope["full_attention"]["rope_theta"],
            "rope_local_base_freq": rope["sliding_attention"]["rope_theta"], "rope_scaling": None,
            "_sliding_window_pattern": 6, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
            "torch_dtype": "float32", "transformers_version": "4.55.0.dev0"}


def test_hub_id_loads_offline_from_the_hub_cache(tiny, tmp_path, monkeypatch):
    """``popjax.load("google/gemma-3-270m")`` resolves the id in an offline hub cache (refs/main ->
    snapshots/<commit>) holding a tiny Gemma 3 with the released config layout, converts it into
    popjax's cache, and computes transformers' logits."""
    source, hf_model = tiny("period6-tied")
    repo = tmp_path / "hub" / "models--google--gemma-3-270m"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(source, snapshot)
    config = snapshot / "config.json"
    config.write_text(json.dumps(released_layout(json.loads(config.read_text()))))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))

    model = popjax.load("google/gemma-3-270m", dtype="float32")
    (entry,) = cache.list_entries(tmp_path / "cache")
    assert entry.kind == "converted" and entry.key.startswith(f"google--gemma-3-270m-{COMMIT[:8]}-float32-")
    assert config_differences(model.config, ModelConfig.from_json(source / "config.json")) == {}
    ids = [5, 9, 17, 33, 2, 70, 11, 40, 8, 99, 3, 64]  # 12 tokens: past the window of 8
    np.testing.assert_allclose(np.asarray(popjax.forward(model, [ids]))[0], hf_logits(hf_model, ids), atol=ATOL, rtol=0)
