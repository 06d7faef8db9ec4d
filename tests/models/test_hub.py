"""``popjax.load("owner/name")`` resolves a Hugging Face repo id through huggingface_hub, tested
offline against a hub cache layout the test writes itself (refs/main -> snapshots/<commit>); and
what `popjax.load` keeps of a source: one `popjax.cache` entry of kind "converted" (made once,
checked on every load, made again when corrupt, its killed builders swept)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from huggingface_hub import constants

import popjax
from popjax import cache, loading
from popjax.convert.readers import CheckpointError
from popjax.loading import hub_snapshot

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_checkpoints):
    """An offline hub cache holding repo ``acme/tiny-llama`` (the tiny llama-gqa checkpoint, plus a
    .bin file that the allow-patterns must never need)."""
    source, _ = tiny_checkpoints("llama-gqa")
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(source, snapshot)
    (snapshot / "pytorch_model.bin").write_bytes(b"not needed")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return source, snapshot


def test_repo_id_resolves_to_the_cached_snapshot(hub_cache):
    source, snapshot = hub_cache
    assert hub_snapshot("acme/tiny-llama") == snapshot
    from_hub = popjax.load("acme/tiny-llama", cache=False)
    direct = popjax.load(source, cache=False)
    ids = [[5, 9, 17, 33, 2, 70]]
    np.testing.assert_array_equal(np.asarray(popjax.forward(from_hub, ids)), np.asarray(popjax.forward(direct, ids)))
    assert from_hub.config == direct.config


def test_repo_missing_offline_is_a_clear_error(hub_cache):
    with pytest.raises(CheckpointError, match=r"'acme/absent'.*hub cache"):
        popjax.load("acme/absent", cache=False)


def test_a_local_path_wins_over_a_repo_id(tmp_path, monkeypatch, tiny_checkpoints):
    source, _ = tiny_checkpoints("llama-gqa")
    local = tmp_path / "acme" / "tiny"
    shutil.copytree(source, local)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert popjax.load("acme/tiny", cache=False).config == popjax.load(source, cache=False).config


# ------------------------------------------------------------------ the converted cache


def temp_dirs(kind_dir):
    return sorted(name for name in os.listdir(kind_dir) if ".tmp-" in name)


def test_a_repo_is_converted_once_and_read_from_the_cache(hub_cache, tmp_path, monkeypatch):
    """A hit never converts; with the manifest check of large entries (forced here) orbax's
    restore leaves the entry as recorded, so no load ever finds it changed and rebuilds it."""
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "FULL_VERIFY_MAX_BYTES", 0)
    first = popjax.load("acme/tiny-llama", dtype="float32")
    (entry,) = cache.list_entries(tmp_path / "cache")
    assert entry.kind == "converted" and entry.key.startswith(f"acme--tiny-llama-{COMMIT[:8]}-float32-")
    assert entry.key_fields["source"] == str(hub_cache[1].resolve()) and entry.key_fields["dtype"] == "float32"
    stamps = {p: p.stat().st_mtime_ns for p in entry.path.rglob("*") if p.is_file()}
    monkeypatch.setattr(loading, "_convert", lambda *a: pytest.fail("converted again on a cache hit"))
    second = popjax.load("acme/tiny-llama", dtype="float32")
    assert {p: p.stat().st_mtime_ns for p in entry.path.rglob("*") if p.is_file()} == stamps
    assert cache.check_entry(entry.path) is None and temp_dirs(entry.path.parent) == []
    ids = [[5, 9, 17, 33, 2, 70]]
    np.testing.assert_array_equal(np.asarray(popjax.forward(first, ids)), np.asarray(popjax.forward(second, ids)))


def test_a_corrupt_conversion_is_made_again_with_one_notice(tiny_checkpoints, tmp_path, monkeypatch, caplog):
    source, _ = tiny_checkpoints("llama-gqa")
    monkeypatch.setenv("POPJAX_CACHE", str(tmp_path / "cache"))
    popjax.load(source, dtype="float32")
    (entry,) = cache.list_entries(tmp_path / "cache")
    config = entry.path / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 65'))
    with caplog.at_level(logging.WARNING, logger=cache.log.name):
        model = popjax.load(source, dtype="float32")
    notices = [r.getMessage() for r in caplog.records if r.name == cache.log.name]
    assert len(notices) == 1 and "fails its checksum" in notices[0] and "\n" not in notices[0], notices
    assert model.config.hidden_size == 64 and cache.check_entry(entry.path) is None


KILLED_CONVERSION = """
import os, sys, time
import popjax
from popjax import loading

def saver(kind, path):
    def save(target):
        print("ready", flush=True)  # params written; the tokenizer never comes
        time.sleep(300)
    return save

loading._tokenizer_saver = saver
popjax.load(sys.argv[1], dtype="float32")
"""


def test_a_conversion_killed_with_sigkill_is_swept(tiny_checkpoints, tmp_path, monkeypatch):
    """SIGKILL runs no cleanup: the dead converter's temp dir stays until the next load of the
    kind, which sweeps it (its lock is free) and converts cleanly."""
    source, _ = tiny_checkpoints("llama-gqa")
    root = tmp_path / "cache"
    env = {**os.environ, "POPJAX_CACHE": str(root), "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, "-c", KILLED_CONVERSION, str(source)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
        [tmp] = temp_dirs(root / "converted")
        assert f".tmp-{child.pid}-" in tmp and (root / "converted" / tmp / "params").is_dir()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        child.stdout.close()
    assert temp_dirs(root / "converted") == [tmp] and cache.list_entries(root) == []
    monkeypatch.setenv("POPJAX_CACHE", str(root))
    model = popjax.load(source, dtype="float32")
    assert temp_dirs(root / "converted") == [] and [e.kind for e in cache.list_entries(root)] == ["converted"]
    assert model.config.num_key_value_heads == 2
