"""Fixtures shared by the kernel tests in this folder."""

from __future__ import annotations

import pytest

import popjax


@pytest.fixture(scope="session")
def gemma3(tiny_checkpoints):
    """The tiny Gemma 3 (GeGLU FFN, sliding-window layers), loaded once per worker: the kernel
    paths' second FFN activation."""
    directory, _ = tiny_checkpoints("gemma3-window")
    return popjax.load(directory, cache=False)
