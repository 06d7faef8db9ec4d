"""``popjax.load("owner/name")`` resolves a Hugging Face repo id through huggingface_hub, tested
offline against a hub cache layout the test writes itself (refs/main -> snapshots/<commit>)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from huggingface_hub import constants

import popjax
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
