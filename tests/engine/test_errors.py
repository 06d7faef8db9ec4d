"""Bad input gets a clear error naming the problem — never a traceback from deep inside JAX."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import popjax
from popjax import cache
from popjax.convert import CheckpointError
from popjax.convert import store
from popjax.models import ConfigError


@pytest.fixture
def checkpoint_copy(tiny_checkpoints, tmp_path):
    """A writable copy of a tiny LLaMA checkpoint."""
    source, _ = tiny_checkpoints("llama-gqa")
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def _edit_tensors(directory: Path, edit) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        popjax.load(tmp_path / "nowhere")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        popjax.load(tmp_path / "model.gguf")


def test_missing_shard_file(checkpoint_copy):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (checkpoint_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is missing"):
        popjax.load(checkpoint_copy, cache=False)


def test_corrupt_safetensors(checkpoint_copy):
    file = checkpoint_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt"):
        popjax.load(checkpoint_copy, cache=False)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt or unreadable GGUF"):
        popjax.load(bad, cache=False)


def test_missing_tensor(checkpoint_copy):
    _edit_tensors(checkpoint_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 parameter\(s\): layers.1.mlp.up"):
        popjax.load(checkpoint_copy, cache=False)


def test_unmapped_tensor(checkpoint_copy):
    _edit_tensors(checkpoint_copy, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.extra.weight'.*no mapping"):
        popjax.load(checkpoint_copy, cache=False)


def test_tensor_the_config_does_not_have(checkpoint_copy):
    _edit_tensors(checkpoint_copy, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(CheckpointError, match="does not have"):
        popjax.load(checkpoint_copy, cache=False)


def test_misshaped_tensor(checkpoint_copy):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :50].copy()

    _edit_tensors(checkpoint_copy, shrink)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight' .* shape \(64, 50\).*expected \(64, 96\)"):
        popjax.load(checkpoint_copy, cache=False)


def test_unsupported_architecture(checkpoint_copy):
    _edit_config(checkpoint_copy, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="unsupported architecture model_type='gpt2'.*supported"):
        popjax.load(checkpoint_copy, cache=False)


def test_unsupported_rope_type(checkpoint_copy):
    _edit_config(checkpoint_copy, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="unsupported rope_type='yarn'.*llama3"):
        popjax.load(checkpoint_copy, cache=False)


def test_bad_dtype(checkpoint_copy):
    with pytest.raises(ValueError, match="dtype='float16'.*bfloat16"):
        popjax.load(checkpoint_copy, dtype="float16")


def test_empty_prompt(tiny_model):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        popjax.generate(tiny_model, "   ")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        popjax.generate_ids(tiny_model, [[5, 6], []])


def test_prompt_longer_than_context(tiny_model):
    with pytest.raises(ValueError, match="250 tokens; with max_new_tokens=10 that exceeds the model's context of 256"):
        popjax.generate_ids(tiny_model, [[5] * 250], max_new_tokens=10)


def test_token_ids_outside_vocabulary(tiny_model):
    with pytest.raises(ValueError, match=r"outside \[0, 160\)"):
        popjax.generate_ids(tiny_model, [[5, 999]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_k=-3), "top_k=-3"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
    ],
)
def test_invalid_sampling_values(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        popjax.generate_ids(tiny_model, [[5, 6]], **kwargs)


def test_interrupted_conversion_leaves_no_cache_entry(checkpoint_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))

    def interrupted(target):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C half-way through writing

    monkeypatch.setattr(popjax.loading, "_tokenizer_saver", lambda kind, path: interrupted)
    with pytest.raises(KeyboardInterrupt):
        popjax.load(checkpoint_copy)
    converted = tmp_path / "cache" / "converted"
    # neither an entry nor a temp directory is left (the key's lock file may stay: no one holds it)
    assert [p for p in converted.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))
    model = popjax.load(checkpoint_copy)  # the next load converts cleanly and caches
    entries = [e.path for e in cache.list_entries(tmp_path / "cache")]
    assert len(entries) == 1 and entries[0].parent == converted and store.is_converted(entries[0])
    assert model.config.num_key_value_heads == 2


def test_converted_store_of_another_format_is_refused(checkpoint_copy, tmp_path, monkeypatch):
    """A store written in another layout (format 2 kept q/k/v and gate/up apart) is never read
    as if it were fused: the error names both formats and says to convert again."""
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))
    popjax.load(checkpoint_copy)
    (directory,) = [e.path for e in cache.list_entries(tmp_path / "cache")]
    marker = directory / store.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "format_version": 2}))
    with pytest.raises(ValueError, match=rf"popjax format 2, this popjax reads {store.FORMAT_VERSION}; convert the source again"):
        popjax.load(directory)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batches", "-1"], "batches=[-1]: -1 is invalid; give integers ≥ 1, e.g. 1,8"),
        (["--batches", "1,0"], "batches=[1, 0]: 0 is invalid"),
        (["--ratios", "1.5"], "ratios=[1.5]: 1.5 is invalid; give global pruning ratios in [0, 1)"),
        (["--methods", "pop,bogus"], "unknown method 'bogus'; valid methods: ["),
        (["--methods", "pop,"], "methods=['pop', '']: a method name is empty"),
        (["--length-methods", "nope"], "unknown method 'nope'"),
        (["--prompt-lengths", "128,0"], "prompt_lengths=[128, 0]: 0 is invalid; give integers in [1, 8192]"),
        (["--suites", "decode,speed"], "suites=['decode', 'speed']: 'speed' is not a suite; choose from decode, lengths,"),
        (["--max-new-tokens", "1"], "max_new_tokens=1 is invalid; decode speed needs an integer in [2, "),
        (["--repeats", "0"], "repeats=0 is invalid; use an integer ≥ 1"),
    ],
)
def test_bench_rejects_bad_values_before_loading(flags, message, monkeypatch, capsys):
    from popjax.cli import main

    monkeypatch.setattr("popjax.bench.runner.load", lambda *a, **k: pytest.fail("loaded a model for an invalid request"))
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("popjax: error: ") and message in err and err.count("\n") == 1, err  # one line
