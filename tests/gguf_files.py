"""GGUF files written from tiny transformers Gemma 3 models the way llama.cpp's converter writes
them (``conversion/gemma.py`` ``Gemma3Model`` on top of ``conversion/base.py`` ``TextModel``):
architecture "gemma3", its metadata keys, gguf-py's own HF -> GGUF tensor names, every
``*norm.weight`` stored as 1 + w, 1-D tensors and norms in F32 and the matrices in the file type
(F32, F16 or Q8_0), and a sentencepiece ("llama") vocabulary whose ids match the model's.

Tests-only: nothing here is imported by popjax.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

# file type -> (GGUF tensor type of the matrices, general.file_type)
FILE_TYPES = {
    "F32": (QType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (QType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (QType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
PERIOD = 6  # the sliding-window period llama.cpp assumes for Gemma 3 (every 6th layer full)


def period_layer_types(n_layers: int, period: int = PERIOD) -> list[str]:
    """HF ``layer_types`` of llama.cpp's pattern: layer i slides iff i % period < period - 1."""
    return ["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(n_layers)]


def tiny_gemma3(directory: Path, seed: int = 0, **fields):
    """A random tiny ``Gemma3ForCausalLM`` (fields on top of tests.conftest.TINY_BASE), saved as
    fp32 safetensors in ``directory``; its (1 + w) norm weights w drawn from N(0, 0.3²) so they
    matter. Returns the torch model (eval mode)."""
    import torch
    import transformers

    from tests.conftest import TINY_BASE

    config = transformers.Gemma3TextConfig(**{**TINY_BASE, **fields})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def tiny_vocab(size: int, bos: int, eos: int) -> tuple[list[str], list[float], list[int]]:
    """A Gemma-like sentencepiece vocabulary of ``size`` tokens: <pad>, <bos>, <eos>, <unk>,
    ▁, letters, digits, then word prefixes (with and without ▁) so merges exist, then <unusedN>.
    Returns (tokens, scores, token types) as llama.cpp's ``_set_vocab_sentencepiece`` writes them."""
    T = gguf.TokenType
    special = {0: "<pad>", bos: "<bos>", eos: "<eos>"}
    unk = next(i for i in range(size) if i not in special)
    special[unk] = "<unk>"
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("ABCDEFGHIJ0123456789.,!?'")
    for word in ("hello", "world", "the", "cat", "sat", "on", "mat", "gemma", "window"):
        for k in range(2, len(word) + 1):
            pieces += [word[:k], "\u2581" + word[:k]]
    pieces = list(dict.fromkeys(pieces))  # unique, in order
    tokens, scores, types = [], [], []
    rest = iter(pieces)
    for i in range(size):
        if i in special:
            tokens.append(special[i])
            types.append(T.UNKNOWN if i == unk else T.CONTROL)
            scores.append(0.0)
            continue
        piece = next(rest, None)
        tokens.append(piece if piece is not None else f"<unused{i}>")
        types.append(T.NORMAL if piece is not None else T.CONTROL)
        scores.append(-float(i))
    return tokens, scores, types


def _gguf_names(model) -> dict[str, str]:
    """HF tensor name -> GGUF name, by gguf-py's own map for MODEL_ARCH.GEMMA3 (what the converter
    uses); the tied head is not written (llama.cpp reuses token_embd when output is absent)."""
    cfg = model.config
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    names = {}
    for name in model.state_dict():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise KeyError(f"gguf-py has no GEMMA3 name for {name!r}")
        names[name] = mapped
    return names


def add_gemma3_metadata(w: gguf.GGUFWriter, cfg, *, pattern: int | None = None, swa_rope_key: bool = False) -> None:
    """The model keys llama.cpp's converter writes for a HF ``Gemma3TextConfig`` ``cfg``
    (TextModel.set_gguf_parameters, then Gemma3Model.set_gguf_parameters), under ``w.arch``."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    if full.get("rope_type") == "linear":  # the global layers' scaling only
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full["rope_theta"])
    if swa_rope_key:
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)


def add_tiny_vocab(w: gguf.GGUFWriter, cfg) -> None:
    """Gemma3Model.set_vocab: a sentencepiece vocabulary (`tiny_vocab`), add_space_prefix False."""
    tokens, scores, types = tiny_vocab(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_unk_token_id(tokens.index("<unk>"))
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)


def write_gemma3_gguf(
    model, path: Path, file_type: str = "F32", *, arch: str = "gemma3", pattern: int | None = None,
    swa_rope_key: bool = False, drop: tuple[str, ...] = (), replace: dict[str, np.ndarray] | None = None,
) -> Path:
    """Writes ``model`` (a torch Gemma3ForCausalLM) to ``path`` as llama.cpp's converter would.

    Args:
      file_type: "F32", "F16" or "Q8_0" for the 2-D tensors ([out, in], quantized along in).
      arch: general.architecture and the metadata key prefix (another value makes a bad file).
      pattern: also write ``attention.sliding_window_pattern`` (newer files may; the converter
        does not, so llama.cpp's period 6 applies).
      swa_rope_key: also write ``rope.freq_base_swa`` (newer converters do; older files lack it).
      drop / replace: GGUF tensor names to leave out / write with other values (bad files).
    """
    cfg = model.config
    tensor_type, ftype = FILE_TYPES[file_type]
    w = gguf.GGUFWriter(str(path), arch)
    add_gemma3_metadata(w, cfg, pattern=pattern, swa_rope_key=swa_rope_key)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tiny_vocab(w, cfg)
    state = model.state_dict()
    for hf_name, name in _gguf_names(model).items():
        if name in drop:
            continue
        data = state[hf_name].detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # Gemma3Model.norm_shift: Gemma3RMSNorm multiplies by 1 + w
        if replace and name in replace:
            data = replace[name]
        values, raw_dtype = _encode(data, name, tensor_type)
        w.add_tensor(name, values, raw_dtype=raw_dtype)
    _finish(w)
    return path


def write_metadata_only(cfg, path: Path, **options) -> Path:
    """A GGUF with the converter's model keys for ``cfg`` (a Gemma3TextConfig of any size) and a
    stand-in 8-row token_embd, no tokenizer: enough for `readers.gguf_config`, not for loading."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_gemma3_metadata(w, cfg, **options)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    _finish(w)
    return path


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _encode(data: np.ndarray, name: str, tensor_type: QType) -> tuple[np.ndarray, QType]:
    """(values, GGUF type) as ModelBase.prepare_tensors stores a tensor: 1-D tensors and norms in
    F32, the rest in ``tensor_type`` (Q8_0: uint8 blocks from gguf.quants.quantize)."""
    data = np.ascontiguousarray(data, np.float32)
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        tensor_type = QType.F32
    return gguf.quants.quantize(data, tensor_type), tensor_type


def dequantized_model(model, path: Path):
    """A copy of the torch ``model`` holding the weights the GGUF at ``path`` stores (dequantized;
    norms back to w), so a quantized file can be checked against the model it really encodes."""
    import torch

    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    twin = copy.deepcopy(model)
    state = twin.state_dict()
    for hf_name, name in _gguf_names(model).items():
        tensor = stored[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(state[hf_name].shape)
        if hf_name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        state[hf_name] = torch.from_numpy(np.array(values, np.float32))  # a writable copy
    if model.config.tie_word_embeddings:  # else loading the stale head would overwrite the shared embedding
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    twin.load_state_dict(state)
    return twin.eval()
